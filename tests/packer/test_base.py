"""``packer.base``: the one object the sweep asks for the packer's work (open, plan, train, save, export), on the
tiny Llama on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_sweep.errors import ConfigError, UserError
from lora_sweep.packer.api import AdapterSpec, BaseShape, Packer, data, jobs, open_base
from lora_sweep.packer.model.load import load_base
from tests.conftest import DEMO_DATA, need_module


@pytest.fixture(scope="module")
def packer(tiny_dirs) -> Packer:  # noqa: ANN001
    return open_base(str(tiny_dirs("llama")), kernels="torch")


def test_a_pack_trains_its_jobs_and_saves_each_adapter_for_peft(packer: Packer, tmp_path: Path) -> None:
    examples = packer.examples(DEMO_DATA / "arith-train.jsonl", max_length=48)
    assert examples and all(len(e.input_ids) <= 48 for e in examples)
    queue = [jobs.SlotJob(spec, data.adapter_stream(examples, spec, 0, 48), key=name)
            for name, spec in (("a", AdapterSpec(rank=4, max_steps=2, micro_batch=2)),
                               ("b", AdapterSpec(rank=2, max_steps=3, micro_batch=2, targets=("q_proj",))))]
    reports: list[jobs.StepReport] = []
    ends: list[jobs.SlotEnd] = []
    saved = []

    def on_end(done: list[jobs.SlotEnd]) -> None:  # the slots' weights are still in the model here
        ends.extend(done)
        saved.extend(packer.save([(e.slot, tmp_path / str(e.job.key), {"trial": str(e.job.key)}) for e in done]))

    result = packer.train(2, lambda slot: queue.pop(0) if queue else None, on_step=reports.extend, on_end=on_end)
    assert result.step == "eager"
    assert sorted((e.job.key, e.steps, e.reason) for e in ends) == [("a", 2, "finished"), ("b", 3, "finished")]
    assert sorted((r.key, r.slot_step) for r in reports) == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 3)]
    packer.close()  # every write on disk
    assert [f.result() for f in saved] == [tmp_path / str(e.job.key) for e in ends] and packer.save_seconds > 0
    config, tensors = Packer.read_adapter(tmp_path / "b")
    assert (config["r"], config["base_model_name_or_path"]) == (2, packer.source)
    assert tensors and all("q_proj" in k for k in tensors)
    copy = tmp_path / "copy"
    copy.mkdir()
    Packer.write_adapter(copy, config, tensors)
    again, back = Packer.read_adapter(copy)
    assert again == config and all(torch.equal(back[k], t) for k, t in tensors.items())
    Packer.discard_adapter(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(UserError, match="not a PEFT adapter directory"):
        Packer.read_adapter(tmp_path / "a")


def test_the_plan_reads_the_bases_targets_and_shape(packer: Packer) -> None:
    targets = packer.targets(("q_proj", "v_proj"))
    assert targets and all(p.rsplit(".", 1)[1] in ("q_proj", "v_proj") for p in targets)
    assert all(isinstance(s, tuple) and len(s) == 2 for s in targets.values())
    shape = packer.shape()
    assert {leaf for leaf, _, _ in shape.projections} >= {"q_proj", "v_proj"} and shape.param_bytes > 0
    assert packer.forward_seconds() > 0 and packer.probe_steps >= 1
    with pytest.raises(ConfigError, match="nope"):
        packer.targets(("nope",))


def test_what_the_packer_answers_without_a_base_opened(tiny_dirs) -> None:  # noqa: ANN001
    path = str(tiny_dirs("llama"))
    assert Packer.read_tokenizer(path).eos_token_id is not None
    assert Packer.free_memory("cpu") > 0
    assert Packer.measured_on("cpu") == {"device": "cpu", "torch": torch.__version__,
                                         "threads": torch.get_num_threads()}
    assert Packer.shard_load_refusal(path) is None  # a safetensors checkpoint: read by rows
    assert "nf4" in (Packer.shard_load_refusal(path, quantize="nf4") or "")


def test_the_probes_are_sized_for_the_dearest_slot_of_a_space() -> None:
    """DoRA probes where a slot can be DoRA, at the largest dropout the space trains; else plain ones, no dropout."""
    def space(**values: set) -> dict:  # noqa: ANN202
        return Packer.probe_options(lambda name: {"dora": {False}, "dropout": {0.0}, **values}[name])

    assert space(dropout={0.0, 0.3}) == {"dora": False, "dropout": 0.0}
    assert space(dora={False, True}, dropout={0.0, 0.05, 0.2}) == {"dora": True, "dropout": 0.2}
    assert space(dora={True}) == {"dora": True, "dropout": 0.0}


def test_a_sharded_load_holds_a_share_read_by_rows_or_the_whole_base(tiny_dirs) -> None:  # noqa: ANN001
    """A safetensors checkpoint loads by rows (one rank's share and a chunk, ``BaseShape.shard_load``); an NF4 base,
    or a world size with no share computed, loads whole on every rank first."""
    path = str(tiny_dirs("llama"))
    base = BaseShape((("q_proj", 8, 8),), 100_000, shard_peak={2: 70_000}, shard_load={2: 60_000})
    assert Packer.sharded_load_peak(base, 2, path) == (60_000, "each rank reads its shard by rows")
    assert Packer.sharded_load_peak(base, 4, path) == (100_000, "each rank loads the whole base first: no shard "
                                                                "computed")
    peak, how = Packer.sharded_load_peak(base, 2, path, quantize="nf4")
    assert peak == 100_000 and how.startswith("each rank loads the whole base first: ") and "nf4" in how


def test_a_merge_base_is_the_base_the_adapter_trained_against(tiny_dirs) -> None:  # noqa: ANN001
    need_module("torchao", "qlora")
    path = str(tiny_dirs("llama"))
    plain, tokenizer = Packer.merge_base(path)
    nf4, _ = Packer.merge_base(path, "nf4")  # quantised as it trained, dequantized to merge into
    trained, _ = load_base(path, quantize="nf4")  # the base a QLoRA pack trains over: NF4 projections
    name = next(n for n, _ in plain.named_modules() if n.endswith("q_proj"))
    w, q = plain.get_submodule(name).weight, nf4.get_submodule(name).weight
    assert type(nf4.get_submodule(name)) is torch.nn.Linear and not torch.equal(w, q)
    assert torch.equal(q, trained.get_submodule(name).dequantized().weight)
    assert tokenizer is not None
