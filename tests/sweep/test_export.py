"""``sweep export``: the exported adapter is the trial's function in PEFT, padded for vLLM or not, and merged.

Every check compares with the engine itself: the study's saved slot loaded into a fresh ``PackedModel`` slot.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_sweep.errors import UserError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.model.checkpoint import read_adapter, save_adapter
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.model.peft_adapter import VLLM_RANKS, merge_adapter, vllm_adapter
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.store.api import ResultsStore, StudyDir
from lora_sweep.sweep.export import export_trial, select_trial
from tests.conftest import load_adapter
from tests.reports._study import ROOT, fixture_study

IDS = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(0))
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="session")
def study(tmp_path_factory, tiny_dirs) -> Path:
    return fixture_study(tmp_path_factory, tiny_dirs)


def _trials(study: Path) -> list:
    with ResultsStore(study / "results.db", create=False) as store:
        return store.trials()


def _engine_logits(model_dir: Path, adapter_dir: Path) -> torch.Tensor:
    """The packed engine's logits for the trial: its saved slot loaded into a fresh slot of a fresh model."""
    cfg, _ = read_adapter(adapter_dir)
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    pm.add_slot(0, AdapterSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], rslora=cfg["use_rslora"],
                               targets=tuple(cfg["target_modules"])))
    load_adapter(pm, 0, adapter_dir)
    with torch.no_grad():
        ours = pm.forward(IDS, MASK, PackLayout((0,), (0,), (2,), (14,), (0.0,), (0,)))
        base = pm.forward(IDS, MASK, None)
    assert (ours - base).abs().max() > 1e-3, "the adapter must move the logits for the comparison to mean anything"
    return ours


def _peft_logits(model_dir: Path, export_dir: Path) -> torch.Tensor:
    """Logits through PEFT, after checking the export loads with no missing and no unexpected keys."""
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(export_dir))
    keys = peft_model.load_adapter(str(export_dir), adapter_name="check")
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    peft_model.set_adapter("default")
    peft_model.eval()
    with torch.no_grad():
        return peft_model(input_ids=IDS, attention_mask=MASK).logits


def _meets_vllm_rules(d: Path, max_lora_rank: int = 512) -> None:
    """The vLLM-free checker of formats-and-eval.md §2."""
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert {"r", "lora_alpha", "target_modules"} <= cfg.keys() and cfg["r"] in VLLM_RANKS
    assert not cfg.get("modules_to_save") and not cfg.get("use_dora") and cfg.get("bias", "none") == "none"
    assert not cfg.get("rank_pattern") and not cfg.get("alpha_pattern") and cfg["r"] <= max_lora_rank
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():
            p = k.split(".")
            assert p[-1] == "weight" and p[-2] in ("lora_A", "lora_B") and "default" not in p, k


def test_export_as_trained_loads_in_peft_with_engine_logits(study: Path, tiny_dirs, tmp_path: Path) -> None:
    rec = next(t for t in _trials(study) if t.state == "COMPLETE")
    done = export_trial(study, tmp_path / "plain", trial=rec.number, vllm=False)
    assert sorted(p.name for p in done.out.iterdir()) == ["README.md", "adapter_config.json",
                                                           "adapter_model.safetensors"]
    src_cfg, src = read_adapter(study / rec.adapter_path)
    cfg, tensors = read_adapter(done.out)
    assert cfg == src_cfg and tensors.keys() == src.keys() and all(torch.equal(tensors[k], src[k]) for k in src)
    card = (done.out / "README.md").read_text()
    assert f"trial {rec.number}" in card and "eval_loss" in card and str(study.resolve()) in card
    assert all(f"| {k} |" in card for k in rec.params)
    torch.testing.assert_close(_peft_logits(tiny_dirs("llama"), done.out),
                               _engine_logits(tiny_dirs("llama"), study / rec.adapter_path), rtol=1e-5, atol=1e-5)


def test_vllm_export_pads_rank_and_keeps_the_function(study: Path, tiny_dirs, tmp_path: Path) -> None:
    odd = [t for t in _trials(study) if t.state == "COMPLETE" and t.params["rank"] not in VLLM_RANKS]
    assert odd and {t.params["rslora"] for t in odd} == {False, True}, "the fixture needs padded rsLoRA and plain"
    for rec in odd:
        done = export_trial(study, tmp_path / f"vllm-{rec.number}", trial=rec.number)
        _meets_vllm_rules(done.out)
        cfg, tensors = read_adapter(done.out)
        r = rec.params["rank"]
        assert done.rank == r and cfg["r"] == done.exported_rank == min(v for v in VLLM_RANKS if v >= r)
        src_cfg, _ = read_adapter(study / rec.adapter_path)
        root = math.sqrt if cfg["use_rslora"] else (lambda x: x)
        assert cfg["lora_alpha"] / root(cfg["r"]) == pytest.approx(src_cfg["lora_alpha"] / root(r), rel=1e-12)
        a = next(v for k, v in tensors.items() if k.endswith("lora_A.weight"))
        assert a.shape[0] == cfg["r"] and torch.count_nonzero(a[r:]) == 0
        torch.testing.assert_close(_peft_logits(tiny_dirs("llama"), done.out),
                                   _engine_logits(tiny_dirs("llama"), study / rec.adapter_path), rtol=1e-5, atol=1e-5)


def test_merged_model_gives_engine_logits(study: Path, tiny_dirs, tmp_path: Path) -> None:
    rec = next(t for t in _trials(study) if t.state == "COMPLETE" and t.params["targets"] == "all")
    done = export_trial(study, tmp_path / "merged", trial=rec.number, merge=True)
    assert done.merged and (done.out / "README.md").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(done.out)).eval()
    AutoTokenizer.from_pretrained(str(done.out))
    with torch.no_grad():
        logits = model(input_ids=IDS, attention_mask=MASK).logits
    torch.testing.assert_close(logits, _engine_logits(tiny_dirs("llama"), study / rec.adapter_path),
                               rtol=1e-4, atol=1e-4)


def test_gpt2_conv1d_merge_and_padding(tiny_dirs, tmp_path: Path) -> None:
    model_dir = tiny_dirs("gpt2")
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    spec = AdapterSpec(rank=6, alpha=9.0, rslora=True, targets=("c_attn", "c_fc", "c_proj"), seed=3)
    pm.add_slot(0, spec)
    with torch.no_grad():  # B starts at zero: give the adapter a real effect
        for p in pm.slot_parameters(0):
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    adapter = save_adapter(pm, 0, tmp_path / "slot", base_model_name_or_path=str(model_dir))
    engine = _engine_logits(model_dir, adapter)
    cfg, tensors = read_adapter(adapter)
    assert cfg["fan_in_fan_out"] is True
    fresh = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    merge_adapter(fresh, cfg, tensors)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=IDS, attention_mask=MASK).logits, engine, rtol=1e-4, atol=1e-4)
    new_cfg, new_tensors, changes = vllm_adapter(cfg, tensors)
    assert new_cfg["r"] == 8 and changes
    (tmp_path / "padded").mkdir()
    save_file(new_tensors, str(tmp_path / "padded" / "adapter_model.safetensors"))
    (tmp_path / "padded" / "adapter_config.json").write_text(json.dumps(new_cfg))
    torch.testing.assert_close(_peft_logits(model_dir, tmp_path / "padded"), engine, rtol=1e-5, atol=1e-5)


def test_vllm_conversion_folds_patterns_and_adapter_names(tiny_dirs, tmp_path: Path) -> None:
    model_dir = tiny_dirs("llama")
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], rank_pattern={"q_proj": 4},
                     alpha_pattern={"q_proj": 32}, init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg).eval()
    peft_model.save_pretrained(str(tmp_path / "patterns"))
    with torch.no_grad():
        want = peft_model(input_ids=IDS, attention_mask=MASK).logits
    config, tensors = read_adapter(tmp_path / "patterns")
    tensors = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}  # keys as in memory
    new_cfg, new_tensors, changes = vllm_adapter(config, tensors)
    assert new_cfg["r"] == 8 and new_cfg["rank_pattern"] == {} and new_cfg["alpha_pattern"] == {} and len(changes) == 2
    (tmp_path / "out").mkdir()
    save_file(new_tensors, str(tmp_path / "out" / "adapter_model.safetensors"))
    (tmp_path / "out" / "adapter_config.json").write_text(json.dumps(new_cfg))
    _meets_vllm_rules(tmp_path / "out")
    torch.testing.assert_close(_peft_logits(model_dir, tmp_path / "out"), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="DoRA"):
        vllm_adapter({**config, "use_dora": True}, tensors)
    assert load_file(str(tmp_path / "out" / "adapter_model.safetensors")).keys() == new_tensors.keys()


def _hand_store(tmp_path: Path, objectives: list[str], directions: list[str], values: list[list[float]]) -> Path:
    sdir = StudyDir(tmp_path / "hand").create()
    sdir.write_study_yaml("name: hand\n")
    with ResultsStore(sdir.results_db) as store:
        store.set_meta(name="hand", objectives=objectives, directions=directions)
        for i, v in enumerate(values):
            store.upsert_trial(i, state="COMPLETE", objective_values=v)
        store.upsert_trial(len(values), state="COMPLETE", objective_values=[math.nan] * len(objectives))
    return sdir.results_db


def test_select_best(tmp_path: Path) -> None:
    db = _hand_store(tmp_path / "one", ["acc"], ["maximize"], [[0.5], [0.7], [0.7], [0.1]])
    with ResultsStore(db) as store:
        assert select_trial(store, best=True).number == 1  # ties: the lowest number; NaN trial ignored
    db = _hand_store(tmp_path / "two", ["loss", "size"], ["minimize", "minimize"], [[1.0, 9.0], [2.0, 1.0],
                                                                                    [3.0, 5.0]])
    with ResultsStore(db) as store:
        assert select_trial(store, best=True, objective="size").number == 1
        assert select_trial(store, best=True, objective="loss").number == 0
        with pytest.raises(UserError, match=r"Pareto trials: #0 \(loss=1, size=9\); #1 \(loss=2, size=1\);"):
            select_trial(store, best=True)
        with pytest.raises(UserError, match="exactly one"):
            select_trial(store, trial=0, best=True)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_sweep", "export", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("case", ["not_a_study", "not_complete", "no_such_trial", "bad_objective", "ambiguous",
                                  "out_not_empty"])
def test_cli_bad_input_one_line_exit_2(study: Path, tmp_path: Path, case: str) -> None:
    trials = _trials(study)
    pruned = next(t.number for t in trials if t.state == "PRUNED")
    done = next(t.number for t in trials if t.state == "COMPLETE")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    args, message = {
        "not_a_study": ([str(tmp_path), "--trial", "0"], "not a study directory"),
        "not_complete": ([str(study), "--trial", str(pruned)], f"trial {pruned} is pruned"),
        "no_such_trial": ([str(study), "--trial", "999"], "trial 999 does not exist"),
        "bad_objective": ([str(study), "--best", "--objective", "accuracy"], "'accuracy' is not an objective"),
        "ambiguous": ([str(study), "--best"], "; choose one with --trial N, or pass --objective 'eval_loss' or "),
        "out_not_empty": ([str(study), "--trial", str(done)], "exists and is not empty"),
    }[case]
    out = tmp_path / ("full" if case == "out_not_empty" else "new")
    proc = _cli(*args, "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: export: ") and proc.stderr.count("\n") == 1 and message in proc.stderr
    assert not (tmp_path / "new").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_exports(study: Path, tmp_path: Path) -> None:
    proc = _cli(str(study), "--best", "--objective", "eval_loss", "--out", str(tmp_path / "best"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("trial ") and (tmp_path / "best" / "adapter_config.json").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("merge", [False, True])
def test_export_modes_follow_the_umask_like_plain_files(study: Path, tmp_path: Path, umask: int, merge: bool) -> None:
    """A serving process of another user can read an export: 0755 / 0644 under umask 022, not mkdtemp's 0700."""
    import os
    import stat

    done = next(t.number for t in _trials(study) if t.state == "COMPLETE")
    old = os.umask(umask)
    try:
        export_trial(study, tmp_path / "out", trial=done, merge=merge)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    for path in [out, *out.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == want, f"{path}: {oct(path.stat().st_mode)}"


# ---------------------------------------------------------------- every variant exports to what PEFT loads


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_dirs) -> Path:
    """A study over DoRA x PiSSA x LoRA+ (``lr_ratio``), one trial each (grid), trained enough to move the logits."""
    from lora_sweep.sweep.config.loader import load_study
    from lora_sweep.sweep.study import run_study
    from tests.conftest import write_study

    tmp = tmp_path_factory.mktemp("variants")
    space = {"dora": [False, True], "init": ["gaussian", "pissa"], "lr_ratio": [1, 8]}
    path = write_study(tmp, tiny_dirs("llama"), "variants", search=space,
                       sampler={"name": "grid"}, train={"max_steps": 4, "micro_batch": 2, "rank": 4, "lr": 1e-2},
                       budget={"trials": 8}, pruning={"kind": "none"}, evaluators=[{"name": "heldout_loss"}],
                       objectives=[{"metric": "eval_loss", "direction": "minimize"}])
    spec = load_study(path)
    run_study(spec, log=lambda m: None)
    return spec.out_dir


@pytest.mark.parametrize(("dora", "init", "lr_ratio"), [(True, "gaussian", 1), (False, "pissa", 1),
                                                         (False, "gaussian", 8), (True, "pissa", 8)])
def test_every_variant_exports_by_default_to_what_peft_loads(variants: Path, tiny_dirs, tmp_path: Path, dora: bool,
                                                             init: str, lr_ratio: int) -> None:
    """The default export (``vllm=True``) of a DoRA trial is the adapter as trained, with a note; of the others the
    vLLM-ready adapter. Both load in PEFT with no missing or unexpected keys and give the merged model's logits."""
    rec = next(t for t in _trials(variants) if (t.params["dora"], t.params["init"], t.params["lr_ratio"])
               == (dora, init, lr_ratio))
    done = export_trial(variants, tmp_path / "default", trial=rec.number)
    cfg, _ = read_adapter(done.out)
    if dora:
        assert done.note == ("export: not padded for vLLM: the adapter uses DoRA, which vLLM does not support (it "
                             "loads in PEFT as trained)")
        assert cfg["use_dora"] and done.exported_rank == done.rank and done.changes == []
    else:
        assert done.note is None
        _meets_vllm_rules(done.out)
    merged = export_trial(variants, tmp_path / "merged", trial=rec.number, merge=True)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(merged.out)).eval()(input_ids=IDS, attention_mask=MASK).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_dirs("llama"))).eval()(input_ids=IDS,
                                                                                    attention_mask=MASK).logits
    assert (want - base).abs().max() > 1e-3, "the adapter must move the logits for the comparison to mean anything"
    torch.testing.assert_close(_peft_logits(tiny_dirs("llama"), done.out), want, rtol=1e-4, atol=1e-4)


def test_sweep_export_of_a_dora_trial_succeeds_with_one_note(variants: Path, tmp_path: Path) -> None:
    rec = next(t for t in _trials(variants) if t.params["dora"])
    proc = _cli(str(variants), "--trial", str(rec.number), "--out", str(tmp_path / "dora"))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines() == [
        "export: not padded for vLLM: the adapter uses DoRA, which vLLM does not support (it loads in PEFT as trained)",
        f"trial {rec.number}: adapter (rank {rec.params.get('rank', 4)}) written to {tmp_path / 'dora'}"]


# ---------------------------------------------------------------- an export stopped, or refused by the disk


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_export_leaves_no_out_and_the_same_command_succeeds(study: Path, tmp_path: Path, sig) -> None:
    rec = next(t for t in _trials(study) if t.state == "COMPLETE")
    out = tmp_path / "merged"
    command = [sys.executable, "-m", "lora_sweep", "export", str(study), "--trial", str(rec.number), "--merge",
               "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".merged.partial-*")):  # the export is under way: its scratch directory
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stop = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), stderr
    said = f"export: {stop}: nothing written to {out}; run the same command again to export"
    assert stderr.strip().splitlines() == [said]  # (click writes a blank line first on a KeyboardInterrupt)
    assert stdout == "" and list(tmp_path.iterdir()) == []
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (out / "config.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_a_signal_right_after_the_scratch_directory_is_made_leaves_nothing(study: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """A signal can land after ``mkdir`` made the scratch directory and before any name held it (a busy host
    deschedules the export there): CI saw one SIGTERM in that gap leave ``.merged.partial-*`` behind."""
    made = os.mkdir

    def mkdir_then_signal(path, *args, **kwargs):
        made(path, *args, **kwargs)
        if ".partial-" in os.fspath(path):
            raise KeyboardInterrupt  # what the signal handler raises at the next bytecode

    monkeypatch.setattr(os, "mkdir", mkdir_then_signal)
    rec = next(t for t in _trials(study) if t.state == "COMPLETE")
    with pytest.raises(KeyboardInterrupt):
        export_trial(study, tmp_path / "out", trial=rec.number)
    assert list(tmp_path.iterdir()) == []


def test_a_scratch_directory_left_by_a_dead_export_is_removed_and_a_live_ones_kept(study: Path,
                                                                                  tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".out.partial-{int(gone.stdout)}-x1y2"
    live = tmp_path / f".out.partial-{os.getpid()}-x3y4"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    rec = next(t for t in _trials(study) if t.state == "COMPLETE")
    export_trial(study, tmp_path / "out", trial=rec.number)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "out"])


def test_an_unwritable_out_is_named_as_given(study: Path, tmp_path: Path) -> None:
    """Root ignores file modes: a read-only tmpfs refuses it (skipped where ``mount`` is refused, as in
    tests/sweep/test_disk_faults.py)."""
    disk = tmp_path / "ro"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is refused here ({mounted.stderr.strip() or mounted.returncode}): it needs root "
                    f"with CAP_SYS_ADMIN, which CI has")
    try:
        rec = next(t for t in _trials(study) if t.state == "COMPLETE")
        proc = _cli(str(study), "--trial", str(rec.number), "--out", str(disk / "adapter"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: export: {disk / 'adapter'}: read-only file system"]
