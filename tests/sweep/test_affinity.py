"""Workers' CPU shares: disjoint contiguous splits, Linux CPU lists both ways, bad lists named."""

from __future__ import annotations

import pytest

from lora_sweep.errors import UserError
from lora_sweep.sweep.affinity import cpu_list, cpu_shares, parse_cpu_list


def test_cpu_shares_and_lists() -> None:
    assert cpu_shares([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert cpu_shares([0, 1], 3) == [[], [], []], "fewer CPUs than workers: nobody is pinned"
    assert cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert parse_cpu_list("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a", "3-1", "-2", "0-"):
        with pytest.raises(UserError, match="--cpus"):
            parse_cpu_list(bad)
