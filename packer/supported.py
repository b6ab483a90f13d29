"""What the packer supports, by name: the values a study file is checked against before any base is opened
(``packer.api.supported``).

Each is owned where the packer uses it and gathered here, so that the config layer checks a study file against one
light module and loading it imports no torch:

- ``FORMATS``: the training rows' formats (``packer.data.rows``; ``data.format: auto`` picks one of them);
- ``line_bound``: the longest data line read for rows cut to ``max_length`` tokens (``packer.data.lines``);
- ``QUANTIZE``: the base's quantizations besides none (``model.quantize``; ``packer.model``);
- ``ALL_LINEAR``: the target naming every linear projection, PEFT's ``"all-linear"`` (``packer.plan``);
- ``FAMILY_NAMES``: the model families, ``config.model_type`` (``packer.families``: ``sweep tiny-model --family``).
"""

from __future__ import annotations

from lora_sweep.packer.data.lines import line_bound
from lora_sweep.packer.data.rows import FORMATS
from lora_sweep.packer.families import FAMILY_NAMES
from lora_sweep.packer.model import QUANTIZE
from lora_sweep.packer.plan import ALL_LINEAR

__all__ = ["ALL_LINEAR", "FAMILY_NAMES", "FORMATS", "QUANTIZE", "line_bound"]
