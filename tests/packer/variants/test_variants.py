"""The variant seam's own rules: a slot's variants compose from its spec, and the optimizer columns a variant names
are the kernels' table."""

from __future__ import annotations

from lora_sweep.packer.model.store import OPT_FIELDS
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.optim import NOOP, optimizer_row
from lora_sweep.packer.variants import BUILT_IN, OPT_COLUMNS, of


def test_a_slots_variants_compose_from_its_spec() -> None:
    assert [v.name for v in of(AdapterSpec())] == ["lora"]
    assert [v.name for v in of(AdapterSpec(init="pissa", dora=True, lr_ratio=4.0))] == ["principal", "dora", "loraplus"]
    assert [v.name for v in of(AdapterSpec(init="gaussian", lorafa=True))] == ["lora", "lorafa"]
    assert AdapterSpec(rank=8, init="olora").rows == 16 and AdapterSpec(rank=8, dora=True).rows == 8


def test_every_spec_has_exactly_one_init() -> None:
    for spec in (AdapterSpec(init=i) for i in ("kaiming", "gaussian", "pissa", "olora")):
        assert sum(v.init is not None for v in of(spec)) == 1, spec.init
    assert len({v.name for v in BUILT_IN}) == len(BUILT_IN)


def test_the_optimizer_columns_are_the_kernels_table() -> None:
    assert len(OPT_COLUMNS) == OPT_FIELDS == len(NOOP)
    row = dict(zip(OPT_COLUMNS, optimizer_row(AdapterSpec(lr=1e-3, lr_ratio=4.0, weight_decay=0.1), 1e-3, 1),
                   strict=True))
    assert row["decay_b"] == 1 - 4e-3 * 0.1 and row["decay_a"] == 1 - 1e-3 * 0.1  # LoRA+ changes B's columns only
    frozen = dict(zip(OPT_COLUMNS, optimizer_row(AdapterSpec(lorafa=True), 1e-3, 2), strict=True))
    assert frozen["step_a"] == 0.0 and frozen["decay_a"] == 1.0 and frozen["step_b"] < 0  # LoRA-FA: A frozen
