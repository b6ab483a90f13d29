"""The load-time check that a packed row's examples do not attend to each other, on the installed transformers."""

from __future__ import annotations

import pytest

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.packing import SamplePackedStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.isolation import TOLERANCE, check_sample_packing, cross_example_change
from lora_sweep.packer.step.train import SlotJob, train
from tests.conftest import random_examples
from tests.helpers import positions_ignored

SPEC = AdapterSpec(rank=2, lr=1e-2, micro_batch=2, max_steps=2, seed=1, sample_packing=True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_block_diagonal_mask_leaves_the_second_example_unchanged(tiny_dirs, family: str, attn: str) -> None:
    pm = PackedModel(load_base(str(tiny_dirs(family)), attn_implementation=attn)[0])
    assert cross_example_change(pm) == (0.0, 0.0)  # the CPU's kernels: the same values, not merely close ones
    check_sample_packing(pm)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_across_examples_is_measured_and_refused(tiny_dirs, monkeypatch, attn: str) -> None:
    positions_ignored(monkeypatch)
    pm = PackedModel(load_base(str(tiny_dirs("llama")), attn_implementation=attn)[0])
    change, noise = cross_example_change(pm)
    assert change > 100 * TOLERANCE and noise == 0.0
    with pytest.raises(ConfigError, match=rf"^sample_packing: with transformers \S+, llama \({attn} attention\) "
                                          r"lets a packed row's examples attend to each other .*sample_packing: false"):
        check_sample_packing(pm)


def test_training_refuses_a_packed_slot_before_its_first_step(tiny_dirs, monkeypatch) -> None:
    positions_ignored(monkeypatch)
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0])
    queue = [SlotJob(SPEC, SamplePackedStream(random_examples(10, seed=4), 2, 0, 48))]
    steps = []
    with pytest.raises(ConfigError, match="lets a packed row's examples attend to each other"):
        train(pm, 1, lambda slot: queue.pop(0) if queue else None, pad_id=0, on_step=lambda *a: steps.append(a))
    assert steps == []


@pytest.mark.parametrize(("change", "noise", "refused"), [(5e-4, 0.0, False), (2e-3, 0.0, True), (0.03, 0.01, False),
                                                          (0.05, 0.01, True)])
def test_a_change_is_judged_against_the_tolerance_and_the_noise_floor(tiny_dirs, monkeypatch, change: float,
                                                                      noise: float, refused: bool) -> None:
    """Where the kernels tile rows differently (a GPU's, in bf16), the same row at another place in the batch
    changes too: a change within 4x that noise floor is no evidence of attention across examples."""
    import lora_sweep.packer.step.isolation

    monkeypatch.setattr(lora_sweep.packer.step.isolation, "cross_example_change", lambda pm: (change, noise))
    pm = PackedModel(load_base(str(tiny_dirs("llama")))[0])
    if refused:
        with pytest.raises(ConfigError, match="attend to each other"):
            check_sample_packing(pm)
    else:
        check_sample_packing(pm)
