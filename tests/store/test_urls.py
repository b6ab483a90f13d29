"""The one masking of secrets (store/urls.py): every URI's password hidden, in a URI, in a message holding
URIs, in a record; nothing else changed."""

from __future__ import annotations

from lora_sweep.store.api import redact_record, redact_url, strip_password

SECRET = "hunter2-secret"


def test_every_scheme_s_password_is_hidden() -> None:
    for url, shown, stripped in (
        (f"http://alice:{SECRET}@127.0.0.1:5000", "http://alice:***@127.0.0.1:5000", "http://alice@127.0.0.1:5000"),
        (f"https://alice:{SECRET}@mlflow.internal/base?x=1", "https://alice:***@mlflow.internal/base?x=1",
         "https://alice@mlflow.internal/base?x=1"),
        (f"mysql+pymysql://u:{SECRET}@h:3306/db", "mysql+pymysql://u:***@h:3306/db", "mysql+pymysql://u@h:3306/db"),
        ("postgresql://u:p@ss/w@rd@h/db", "postgresql://u:***@h/db", "postgresql://u@h/db"),  # raw @ and /
        ("http://:tok@h", "http://:***@h", "http://@h"),
    ):
        assert redact_url(url) == shown and strip_password(url) == stripped, url


def test_uris_without_a_password_and_other_text_are_left_as_they_are() -> None:
    for plain in ("http://127.0.0.1:5000/api", "mysql+pymysql://u@h/db", "runs/x.log", "sqlite:////tmp/a@b.db",
                  "mail alice@example.com", "databricks://profile", "a:b@c (no scheme)"):
        assert redact_url(plain) == plain and strip_password(plain) == plain, plain


def test_a_message_holding_uris_is_masked_whole() -> None:
    text = (f"API request to http://alice:{SECRET}@127.0.0.1:9/api/2.0/mlflow/runs/create failed; "
            f"also postgresql://bob:{SECRET}x@db/x")
    shown = redact_url(text)
    assert SECRET not in shown
    assert shown == ("API request to http://alice:***@127.0.0.1:9/api/2.0/mlflow/runs/create failed; "
                     "also postgresql://bob:***@db/x")


def test_a_record_is_masked_in_every_string() -> None:
    record = {"storage": "runs/x.log", "trackers": [{"name": "mlflow", "options": {
        "tracking_uri": f"http://alice:{SECRET}@127.0.0.1:5000"}}], "n": 3, "ok": True, "none": None,
        "pair": ("a", f"s3://k:{SECRET}@bucket/x")}
    masked = redact_record(record)
    assert SECRET not in repr(masked)
    assert masked["trackers"][0]["options"]["tracking_uri"] == "http://alice:***@127.0.0.1:5000"
    assert masked["n"] == 3 and masked["ok"] is True and masked["none"] is None and masked["storage"] == "runs/x.log"
    assert masked["pair"] == ("a", "s3://k:***@bucket/x")
