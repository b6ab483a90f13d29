"""``lora_sweep.testing.variant``: the variant contract runs on every built-in variant (one row each: plain LoRA,
DoRA, PiSSA, OLoRA, LoRA+ and LoRA-FA), and a broken variant is named by the promise it breaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import need_triton

need_triton()  # before anything imports the Triton kernel modules (the contract's Triton check)

from lora_sweep.packer.plan import AdapterSpec  # noqa: E402
from lora_sweep.packer.variants import lorafa  # noqa: E402
from lora_sweep.packer.variants.magnitude import Magnitudes  # noqa: E402
from lora_sweep.testing.variant import VariantContract, check_alone_is_peft, check_triton_is_torch  # noqa: E402

PLAIN = AdapterSpec(rank=2, alpha=4, lr=3e-3, micro_batch=1, targets=("q_proj", "v_proj", "down_proj"), max_steps=8,
                    seed=1, max_grad_norm=0.5, warmup_steps=2, schedule="cosine")
"""A slot that clips (at 0.5, which these tiny models' gradients reach), warms up and decays."""

# --8<-- [start:rows]
ROWS = {
    "lora": PLAIN,
    "dora": replace(PLAIN, dora=True),
    "pissa": replace(PLAIN, init="pissa"),
    "olora": replace(PLAIN, init="olora"),
    "loraplus": replace(PLAIN, lr_ratio=8.0),
    # PEFT's LoRA-FA optimizer fixes betas (0.9, 0.999) and eps 1e-6; the projection makes B's steps larger, hence
    # the smaller rate
    "lorafa": replace(PLAIN, lorafa=True, eps=1e-6, lr=1e-3),
}
# --8<-- [end:rows]
"""One row per built-in variant (``packer.variants.BUILT_IN``)."""


@pytest.mark.parametrize("name", list(ROWS))
class TestBuiltInVariant(VariantContract):
    @pytest.fixture
    def spec(self, name: str) -> AdapterSpec:
        return ROWS[name]

    @pytest.mark.gpu
    def test_triton_is_torch(self, spec: AdapterSpec) -> None:
        """Each row on the compiled kernels (the gpu tier)."""
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA (test_triton_is_torch_on_the_cpu runs the row in the CPU's interpreter)")
        check_triton_is_torch(spec, device="cuda")

    @pytest.mark.slow
    def test_triton_is_torch_on_the_cpu(self, spec: AdapterSpec) -> None:
        """Each row in the CPU's Triton interpreter (5-8 CPU seconds a row), where CI has no GPU."""
        if torch.cuda.is_available():  # need_triton sets the interpreter only where there is no CUDA
            pytest.skip("CUDA is here: the gpu tier's test_triton_is_torch runs the row on the compiled kernels")
        check_triton_is_torch(spec, device="cpu")


def test_every_built_in_variant_has_a_row() -> None:
    from lora_sweep.packer.variants import BUILT_IN

    chosen = {name: {v.name for v in spec.variants} for name, spec in ROWS.items()}
    assert {v.name for v in BUILT_IN} <= set().union(*chosen.values())


def test_a_variant_whose_buffers_start_wrong_breaks_alone_is_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite has teeth: DoRA whose magnitudes never start (the slot trains as plain LoRA) is not PEFT's."""
    monkeypatch.setattr(Magnitudes, "start", lambda self, slot, path, w: None)
    with pytest.raises(AssertionError, match="alone = PEFT"):
        check_alone_is_peft(ROWS["dora"])


def test_lorafa_without_the_scale_of_its_projection_breaks_alone_is_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA-FA's row has teeth too: a projection without its 1/s^2 no longer trains as PEFT's."""
    monkeypatch.setattr(lorafa.Gains, "start", lambda self, slot, spec: self.gain.__setitem__(slot, 1.0))
    with pytest.raises(AssertionError, match="alone = PEFT"):
        check_alone_is_peft(ROWS["lorafa"])
