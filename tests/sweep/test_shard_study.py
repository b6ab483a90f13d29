"""``packing.shard: fsdp`` validates, but a study run refuses it (rather than train the base unsharded) until the
run starts the ranks of a sharded pack; nothing of the study is created."""

from __future__ import annotations

import pytest

from lora_sweep.packer.errors import ConfigError
from lora_sweep.sweep.loader import load_study
from lora_sweep.sweep.study import run_study
from tests.conftest import write_study


def test_study_run_refuses_a_sharded_pack(tiny_dirs, tmp_path) -> None:
    spec = load_study(write_study(tmp_path, tiny_dirs("llama"), packing={"max_slots": 2, "shard": "fsdp"}))
    assert spec.packing.shard == "fsdp"
    with pytest.raises(ConfigError, match="packing.shard: fsdp: a study run does not start"):
        run_study(spec, log=lambda m: None)
    assert not spec.out_dir.exists()
