"""``lora_sweep.testing.storage``: the storage contract as a call (``check_storage``) passes a built-in backend and
names the promise a broken one breaks (the pytest suite, ``StorageContract``, runs on every built-in backend in
tests/sweep/test_storage.py)."""

from __future__ import annotations

import pytest

from lora_sweep.testing.storage import check_storage, check_unopenable


def test_a_built_in_backend_keeps_the_contract(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "text.db").write_text("not a database\n" * 100)
    check_storage(f"sqlite:///{tmp_path / 'optuna.db'}", unopenable_url=f"sqlite:///{tmp_path / 'text.db'}")


def test_a_storage_that_opens_where_it_should_not_is_named(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(AssertionError, match=r"opened; expected a one-line UserError"):
        check_unopenable(f"sqlite:///{tmp_path / 'fine.db'}")
