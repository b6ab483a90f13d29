"""``kernels.meta``'s host-side helpers: the rank bucket every shape of a pack is padded to."""

from __future__ import annotations

import pytest

from lora_sweep.kernels.meta import rank_bucket_for


@pytest.mark.parametrize(("rank", "bucket"), [(0, 16), (1, 16), (16, 16), (17, 32), (24, 32), (32, 32), (33, 64),
                                              (256, 256), (257, 512), (512, 512)])
def test_a_rank_bucket_is_a_power_of_two_of_at_least_16(rank: int, bucket: int) -> None:
    assert rank_bucket_for(rank) == bucket
