"""A saved slot is a PEFT adapter: loads with no missing/unexpected keys and gives identical logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import PeftModel
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lora_sweep.errors import UserError
from lora_sweep.kernels.ops import PackLayout
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.checkpoint import read_adapter, save_adapter, save_adapters
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import load_adapter, random_examples

SPECS = {
    "llama": [AdapterSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), lr=1e-2, max_steps=6, seed=1),
              AdapterSpec(rank=8, alpha=16, rslora=True, targets=("all-linear",), lr=1e-2, max_steps=6, seed=2)],
    "gpt2": [AdapterSpec(rank=4, alpha=8, targets=("c_attn", "c_proj"), lr=1e-2, max_steps=6, seed=1),
             AdapterSpec(rank=8, alpha=16, rslora=True, targets=("all-linear",), lr=1e-2, max_steps=6, seed=2)],
}


def _trained_adapters(model_dir, specs, out_root):
    model, _ = load_base(str(model_dir))
    pm = PackedModel(model)
    jobs = [SlotJob(s, SlotStream(random_examples(20, i), 2, seed=i), key=i) for i, s in enumerate(specs)]
    queue = list(jobs)
    saved = {}

    def on_end(ends):  # slots that end together are saved together (one host copy each, parallel writes)
        dirs = save_adapters(pm, [(e.slot, out_root / f"trial-{e.job.key}", None) for e in ends],
                             base_model_name_or_path=str(model_dir))
        saved.update({e.job.key: d for e, d in zip(ends, dirs, strict=True)})
        batches.append(len(ends))

    batches: list[int] = []
    train(pm, len(specs), lambda s: queue.pop(0) if queue else None, pad_id=0, on_end=on_end)
    assert batches == [len(specs)], "the slots end together: one batch of saves"
    return saved


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_saved_slot_loads_in_peft_with_identical_logits(tiny_dirs, tmp_path, family: str) -> None:
    model_dir = tiny_dirs(family)
    saved = _trained_adapters(model_dir, SPECS[family], tmp_path)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for key, adapter_dir in saved.items():
        assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"
        # Independent load: PEFT reads the directory; every saved key must land on a LoRA parameter.
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter_dir))
        peft_model.eval()
        result = set_peft_model_state_dict(peft_model, load_file(str(adapter_dir / "adapter_model.safetensors")))
        assert result.unexpected_keys == []
        assert [k for k in result.missing_keys if "lora_" in k] == []
        # Our engine, the saved adapter loaded back into a fresh slot.
        model, _ = load_base(str(model_dir))
        pm = PackedModel(model)
        pm.add_slot(0, SPECS[family][key])
        load_adapter(pm, 0, adapter_dir)
        layout = PackLayout((0,), (0,), (2,), (12,), (0.0,), (0,))
        with torch.no_grad():
            ours = pm.forward(ids, mask, layout)
            theirs = peft_model(input_ids=ids, attention_mask=mask).logits
            base = pm.forward(ids, mask, None)
        assert (ours - base).abs().max() > 1e-4, "the adapter must change the logits for the check to mean anything"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        assert cfg["r"] == SPECS[family][key].rank and cfg["use_rslora"] == SPECS[family][key].rslora


def test_save_replaces_existing_dir_atomically(tiny_dirs, tmp_path) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    pm = PackedModel(model)
    pm.add_slot(0, AdapterSpec(rank=2, targets=("q_proj",)))
    target = tmp_path / "adapter"
    save_adapter(pm, 0, target, base_model_name_or_path="x")
    save_adapter(pm, 0, target, base_model_name_or_path="y")
    assert json.loads((target / "adapter_config.json").read_text())["base_model_name_or_path"] == "y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_save_fsyncs_the_files_and_the_rename(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Durable before the store records the trial: the files, the folder that holds them, and the parent the
    folder was renamed into (else a power loss may undo the rename of a trial recorded COMPLETE)."""
    model, _ = load_base(str(tiny_dirs("llama")))
    pm = PackedModel(model)
    pm.add_slot(0, AdapterSpec(rank=2, targets=("q_proj",)))
    synced: list[tuple[str, bool]] = []
    fsync = os.fsync

    def recording(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((os.path.basename(path), os.path.isdir(path)))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    save_adapter(pm, 0, tmp_path / "adapter", base_model_name_or_path="x")
    files = {name for name, is_dir in synced if not is_dir}
    assert files == {"adapter_model.safetensors", "adapter_config.json"}
    assert synced[-1] == (tmp_path.name, True), synced  # the parent, after the rename
    assert sum(is_dir for _, is_dir in synced) == 2  # and the temporary folder, before it


def test_read_adapter_names_a_missing_file(tmp_path) -> None:
    with pytest.raises(UserError, match="adapter_config.json: not found"):
        read_adapter(tmp_path / "missing")


def test_a_save_in_another_dtype_holds_each_tensor_cast_and_laid_out_as_peft(tiny_dirs, tmp_path) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    pm = PackedModel(model)
    pm.add_slot(0, SPECS["llama"][0])
    with torch.no_grad():  # B starts at zero: give it values that a wrong layout or cast would show
        for _, b in pm.slot_weights(0).values():
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())))
    saved = load_file(str(save_adapter(pm, 0, tmp_path / "a", base_model_name_or_path="x", dtype=torch.bfloat16)
                          / "adapter_model.safetensors"))
    for path, (a, b) in pm.slot_weights(0).items():
        for kind, want in (("A", a), ("B", b)):
            got = saved[f"base_model.model.{path}.lora_{kind}.weight"]
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert torch.equal(got, want.detach().to(torch.bfloat16))


def _writer_saves_the_weights_as_submitted(model_dir, tmp_path, monkeypatch, device: str) -> None:
    """``AdapterWriter.submit`` snapshots the slot and returns; the slot may train on (here: its B changed) while
    the write waits, and the file holds the weights at the submit, in place only when the future says so."""
    import threading

    from lora_sweep.packer.model import checkpoint

    model, _ = load_base(str(model_dir), device=device)
    pm = PackedModel(model)
    pm.add_slot(0, SPECS["llama"][0])
    with torch.no_grad():
        for _, b in pm.slot_weights(0).values():
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())))
    before = {p: (a.detach().cpu().clone(), b.detach().cpu().clone()) for p, (a, b) in pm.slot_weights(0).items()}
    gate, write = threading.Event(), checkpoint._write
    monkeypatch.setattr(checkpoint, "_write", lambda *job: (gate.wait(30), write(*job))[1])
    with checkpoint.AdapterWriter() as writer:
        [future] = writer.submit(pm, [(0, tmp_path / "a", {"trial": "0"})], base_model_name_or_path="x")
        assert not future.done() and not (tmp_path / "a").exists()
        with torch.no_grad():  # the slot trains on (or is refilled) while the write is queued
            for _, b in pm.slot_weights(0).values():
                b.add_(1.0)
        gate.set()
        assert future.result(timeout=60) == tmp_path / "a"
    assert writer.busy_s > 0
    _, saved = read_adapter(tmp_path / "a")
    for path, (a, b) in before.items():
        assert torch.equal(saved[f"base_model.model.{path}.lora_A.weight"], a)
        assert torch.equal(saved[f"base_model.model.{path}.lora_B.weight"], b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_writer_returns_before_the_write_and_saves_the_weights_as_they_were(tiny_dirs, tmp_path, monkeypatch) -> None:
    _writer_saves_the_weights_as_submitted(tiny_dirs("llama"), tmp_path, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_writer_on_cuda_copies_to_pinned_memory_before_the_slot_trains_on(tiny_dirs, tmp_path, monkeypatch) -> None:
    """From the GPU the host copy is non_blocking into pinned memory; the weights changed right after the submit
    (a later kernel on the same stream) are not what is saved."""
    _writer_saves_the_weights_as_submitted(tiny_dirs("llama"), tmp_path, monkeypatch, "cuda")


def test_a_failed_write_is_the_futures_error_and_leaves_no_directory(tiny_dirs, tmp_path) -> None:
    model, _ = load_base(str(tiny_dirs("llama")))
    pm = PackedModel(model)
    pm.add_slot(0, AdapterSpec(rank=2, targets=("q_proj",)))
    (tmp_path / "file").write_text("")  # a path below a file: the write's mkdir fails
    from lora_sweep.packer.model.checkpoint import AdapterWriter

    with AdapterWriter() as writer:
        [future] = writer.submit(pm, [(0, tmp_path / "file" / "a", None)], base_model_name_or_path="x")
        with pytest.raises(OSError):
            future.result(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
