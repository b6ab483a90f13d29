"""Packed multi-adapter LoRA training over one frozen base model."""

import logging as _logging

# torchao (the qlora extra, packer.model.quant) is imported by transformers whenever it is installed; at import it logs
# a warning for each optional C++ extension the installed torch cannot load, and torch one for each enum it
# registers. None of those extensions is used here (NF4 is plain PyTorch): keep them off every command's stderr.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
