"""LoRA-FA's own rules beyond the contract row (tests/testing/test_variant_suite.py): a slot that accumulates
micro-batches has B's gradient projected once, at its optimizer step, and the combinations PEFT's LoRA-FA optimizer
cannot express are refused with the key named."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_sweep.errors import ConfigError
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob
from lora_sweep.testing.variant import default_dtype, initial_a, random_examples, run_packed, run_peft

FA = AdapterSpec(rank=4, alpha=8, lr=1e-3, micro_batch=2, gradient_accumulation_steps=2, max_steps=5, seed=3,
                 targets=("q_proj", "down_proj"), max_grad_norm=0.5, lorafa=True, eps=1e-6)


def test_micro_2_by_accumulation_2_is_peft_lorafa_on_batches_of_4(tiny_dirs) -> None:
    model_dir = tiny_dirs("llama")
    one_batch = replace(FA, micro_batch=4, gradient_accumulation_steps=1)
    with default_dtype(torch.float64):
        job = SlotJob(FA, SlotStream(random_examples(40, seed=100), 2, seed=FA.seed), key=0)
        losses, final = run_packed(model_dir, [job], capacity=1)
        ref = run_peft(model_dir, one_batch, SlotStream(random_examples(40, seed=100), 4, seed=FA.seed),
                       initial_a(model_dir, one_batch))
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref.losses), rtol=1e-6, atol=0)
    for path, (a, b) in final[0].items():
        torch.testing.assert_close(a, ref.weights[path][0], rtol=0, atol=1e-8)  # A frozen: exactly its init
        torch.testing.assert_close(b, ref.weights[path][1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("other, named", [({"dora": True}, "dora"), ({"lr_ratio": 4.0}, "lr_ratio"),
                                          ({"init": "pissa"}, "pissa")])
def test_lorafa_refuses_what_peft_cannot_combine_with_it(other: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^lorafa: does not combine with .*{named}"):
        AdapterSpec(lorafa=True, **other)
