"""Tests of packer/data/rows.py: formats, prompt masking, truncation, error messages, per-slot streams.

Run: python -m pytest tests/packer/data/test_data.py -q
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from lora_sweep.errors import DataError, UserError
from lora_sweep.packer.data.rows import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    IGNORE_INDEX,
    Example,
    SlotStream,
    load_examples,
    read_jsonl,
    tokenize_rows,
)
from tests.damage import judge, rows_cases
from tests.helpers import CHAT_TEMPLATE, CONVERSATION, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(None)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    """Write rows as JSONL; a str row is written verbatim (blank or broken lines)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def trained_runs(tok: PreTrainedTokenizerFast, example: Example) -> list[str]:
    """Decode each maximal run of trained labels."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in example.labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return [tok.decode(run) for run in runs]


def check_masked(tok: PreTrainedTokenizerFast, example: Example, prompt: str, response: str) -> None:
    """-100 exactly on the tokens of the prompt (with BOS); the rest is the response + EOS, trained."""
    n_prompt = len(tok(prompt)["input_ids"])
    assert tok.decode(example.input_ids) == "<s>" + prompt + response + "</s>"
    assert example.labels[:n_prompt] == (IGNORE_INDEX,) * n_prompt
    assert example.labels[n_prompt:] == example.input_ids[n_prompt:]
    assert trained_runs(tok, example) == [response + "</s>"]


# --- formats and masking ---------------------------------------------------------------------------------------


def test_formats_constant_lists_text() -> None:
    assert FORMATS == ("alpaca", "prompt_completion", "chat", "text")


def test_alpaca_with_input_masks_the_prompt(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"instruction": "Add.", "input": "2 + 2", "output": "4"}
    (example,) = load_examples(write_jsonl(tmp_path / "a.jsonl", [row]), tokenizer)
    check_masked(tokenizer, example, ALPACA_PROMPT.format(instruction="Add.", input="2 + 2"), "4")


@pytest.mark.parametrize("extra", [{}, {"input": ""}, {"input": None}])
def test_alpaca_without_input_uses_the_short_template(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, extra: dict
) -> None:
    row = {"instruction": "Say {hello}.", "output": "Hello world!", **extra}
    (example,) = load_examples(write_jsonl(tmp_path / "a.jsonl", [row]), tokenizer)
    check_masked(tokenizer, example, ALPACA_PROMPT_NO_INPUT.format(instruction="Say {hello}."), "Hello world!")


def test_prompt_completion_masks_the_prompt(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    rows = [{"prompt": "Capital of France? ", "completion": "Paris."}, {"prompt": "Q", "completion": ""}]
    first, second = load_examples(write_jsonl(tmp_path / "pc.jsonl", rows), tokenizer)
    check_masked(tokenizer, first, "Capital of France? ", "Paris.")
    check_masked(tokenizer, second, "Q", "")  # an empty completion still teaches EOS


def test_text_trains_every_token(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    (example,) = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello world!"}]), tokenizer)
    assert tokenizer.decode(example.input_ids) == "<s>Hello world!</s>"
    assert example.labels == example.input_ids


@pytest.mark.parametrize(
    "row",
    [
        {"instruction": "Add.", "input": "2 + 2", "output": "4"},
        {"prompt": "Capital of France? ", "completion": "Paris."},
        {"messages": CONVERSATION},
    ],
)
def test_train_on_prompt_changes_labels_only(tokenizer: PreTrainedTokenizerFast, row: dict) -> None:
    (masked,) = tokenize_rows([row], "auto", tokenizer)
    (full,) = tokenize_rows([row], "auto", tokenizer, train_on_prompt=True)
    assert full.input_ids == masked.input_ids
    assert full.labels == full.input_ids
    assert IGNORE_INDEX in masked.labels


def test_chat_with_template_trains_assistant_turns(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    (example,) = load_examples(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}]), tokenizer)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered
    assert example.input_ids.count(tokenizer.bos_token_id) == 1  # the template's BOS, none added on top
    # Each turn's span is its content plus what the template closes it with.
    assert trained_runs(tokenizer, example) == ["Paris.</s>\n", "Hello world!</s>\n"]
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert example.labels[:n_prompt] == (IGNORE_INDEX,) * n_prompt
    assert example.labels[n_prompt] != IGNORE_INDEX


def test_chat_with_chatml_template() -> None:
    chatml = build_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] + '\\n' + m['content'] }}<|im_end|>{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
    )
    (example,) = tokenize_rows([{"messages": CONVERSATION}], "chat", chatml)
    assert chatml.decode(example.input_ids) == chatml.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_runs(chatml, example) == ["Paris.<|im_end|>\n", "Hello world!<|im_end|>\n"]


def test_chat_without_template_uses_plain_rendering(plain_tokenizer: PreTrainedTokenizerFast) -> None:
    (example,) = tokenize_rows([{"messages": CONVERSATION}], "chat", plain_tokenizer)
    assert plain_tokenizer.decode(example.input_ids) == (
        "<s>System: Be brief.\n\nUser: Capital of France?\n\nAssistant: Paris.</s>"
        "\n\nUser: Say hello.\n\nAssistant: Hello world!</s>"
    )
    assert trained_runs(plain_tokenizer, example) == ["Paris.</s>", "Hello world!</s>"]


def test_chat_opening_with_assistant_trains_that_turn(plain_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "assistant", "content": "Hello world!"}]
    (example,) = tokenize_rows([{"messages": messages}], "chat", plain_tokenizer)
    assert plain_tokenizer.decode(example.input_ids) == "<s>Assistant: Hello world!</s>"
    assert example.labels[0] == IGNORE_INDEX  # BOS
    assert trained_runs(plain_tokenizer, example) == ["Assistant: Hello world!</s>"]


def test_chat_template_that_is_not_prefix_stable(tokenizer: PreTrainedTokenizerFast) -> None:
    odd = build_tokenizer("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}{% endfor %}")
    row = {"messages": CONVERSATION[1:3]}
    with pytest.raises(DataError) as err:
        tokenize_rows([row], "chat", odd, source="d.jsonl")
    assert str(err.value).startswith("d.jsonl:1: the chat template does not render conversation prefixes")
    (example,) = tokenize_rows([row], "chat", odd, train_on_prompt=True)
    assert odd.decode(example.input_ids) == "Capital of France?LAST Paris."
    assert example.labels == example.input_ids


def test_chat_template_exception_names_the_row(tokenizer: PreTrainedTokenizerFast) -> None:
    strict = build_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match=r"^d.jsonl:1: chat template failed: roles must alternate$"):
        tokenize_rows([{"messages": CONVERSATION}], "chat", strict, source="d.jsonl")


# --- truncation ------------------------------------------------------------------------------------------------


def test_truncation_keeps_the_start(tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"prompt": "Q", "completion": "Hello world! Hello world!"}
    (whole,) = tokenize_rows([row], "prompt_completion", tokenizer)
    (cut,) = tokenize_rows([row], "prompt_completion", tokenizer, max_length=5)
    assert cut.input_ids == whole.input_ids[:5]
    assert cut.labels == whole.labels[:5]


def test_rows_without_trained_tokens_are_dropped(
    tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {"prompt": "Capital of France? " * 3, "completion": "Paris."},  # the prompt fills max_length
        {"prompt": "Q", "completion": "Paris."},
    ]
    with caplog.at_level(logging.WARNING, logger="lora_sweep.packer.data.rows"):
        examples = tokenize_rows(rows, "prompt_completion", tokenizer, max_length=8, source="d.jsonl")
    assert examples == tokenize_rows(rows[1:], "prompt_completion", tokenizer)
    assert "d.jsonl: rows dropped (no trained token within max_length=8): 1" in caplog.text
    with pytest.raises(DataError, match=r"^d.jsonl: no row has a trained token within max_length=8$"):
        tokenize_rows(rows[:1], "prompt_completion", tokenizer, max_length=8, source="d.jsonl")


def test_conversation_without_assistant_turn_is_dropped(tokenizer: PreTrainedTokenizerFast) -> None:
    rows = [{"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[:3]}]
    assert len(tokenize_rows(rows, "chat", tokenizer)) == 1


def test_a_first_token_alone_is_not_trainable(tokenizer: PreTrainedTokenizerFast) -> None:
    # labels[0] is never a loss target after the causal shift.
    with pytest.raises(DataError, match="no row has a trained token"):
        tokenize_rows([{"text": "Hello"}], "text", tokenizer, max_length=1)


def test_max_length_must_be_positive(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        tokenize_rows([{"text": "Hello"}], "text", tokenizer, max_length=0)


# --- reading, detection and errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        ({"instruction": "Add.", "output": "4"}, "alpaca"),
        ({"prompt": "Q", "completion": "A"}, "prompt_completion"),
        ({"messages": CONVERSATION}, "chat"),
        ({"text": "Hello"}, "text"),
    ],
)
def test_auto_detects_the_format(tmp_path: Path, row: dict, fmt: str) -> None:
    assert read_jsonl(write_jsonl(tmp_path / "d.jsonl", [row, row])) == (fmt, [row, row])
    assert read_jsonl(tmp_path / "d.jsonl", fmt) == (fmt, [row, row])


def test_blank_lines_skipped_line_numbers_kept(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "", "   ", {"text": "b"}, {"txt": "c"}])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}:5: missing field 'text' (text format)"


def test_byte_order_mark_and_crlf_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\r\n{"text": "b"}\r\n')
    assert read_jsonl(path) == ("text", [{"text": "a"}, {"text": "b"}])


@pytest.mark.parametrize(
    ("lines", "fmt", "message"),
    [
        ([{"instruction": "Add."}], "auto", "1: missing field 'output' (alpaca format)"),
        ([{"prompt": "Q", "completion": "A"}], "alpaca", "1: missing field 'instruction' (alpaca format)"),
        (
            ["", '{"text": "a",}'],
            "auto",
            "2: invalid JSON: Expecting property name enclosed in double quotes (column 14)",
        ),
        (['{"text": "a"}', "[1, 2]"], "auto", "2: row must be a JSON object, got list"),
        (["[1, 2]"], "auto", "1: row must be a JSON object, got list"),
        (
            [{"prompt": "Q", "completion": 4}],
            "auto",
            "1: field 'completion' must be a string (prompt_completion format)",
        ),
        (
            [{"instruction": "I", "input": 3, "output": "O"}],
            "auto",
            "1: field 'input' must be a string (alpaca format)",
        ),
        ([{"messages": "hi"}], "auto", "1: field 'messages' must be a list of {role, content}"),
        ([{"messages": []}], "auto", "1: field 'messages' must be a list of {role, content}"),
        ([{"messages": [{"role": "user"}]}], "auto", "1: field 'messages' must be a list of {role, content}"),
        (
            [{"messages": [{"role": "bot", "content": "hi"}]}],
            "chat",
            "1: messages[0] has unknown role 'bot' (expected one of: system, user, assistant)",
        ),
        (
            [{"question": "Q", "answer": "A"}],
            "auto",
            "1: cannot detect the format from keys ['answer', 'question']; expected one of 'messages' (chat), "
            "'instruction' (alpaca), 'prompt' (prompt_completion), 'text' (text)",
        ),
    ],
)
def test_row_errors_name_file_and_line(tmp_path: Path, lines: list[object], fmt: str, message: str) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(DataError) as err:
        read_jsonl(path, fmt)
    assert str(err.value) == f"{path}:{message}"


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        read_jsonl(tmp_path / "x.jsonl")
    assert str(err.value) == f"{tmp_path / 'x.jsonl'}: file not found"
    for content in ["", "\n  \n"]:
        (tmp_path / "empty.jsonl").write_text(content)
        with pytest.raises(DataError) as err:
            read_jsonl(tmp_path / "empty.jsonl")
        assert str(err.value) == f"{tmp_path / 'empty.jsonl'}: no rows"
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"bin.jsonl: not UTF-8 text"):
        read_jsonl(tmp_path / "bin.jsonl")


def test_unknown_format_lists_the_valid_ones(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    expected = "unknown format 'sharegpt' (expected one of: auto, alpaca, prompt_completion, chat, text)"
    with pytest.raises(DataError) as err:
        load_examples(path, tokenizer, fmt="sharegpt")
    assert str(err.value) == f"{path}: {expected}"
    with pytest.raises(DataError) as err:
        tokenize_rows([{"text": "a"}], "sharegpt", tokenizer)
    assert str(err.value) == f"<rows>: {expected}"


def test_load_examples_reports_file_lines_at_tokenize_time(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    strict = build_tokenizer("{{ raise_exception('no') }}")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, ""])
    path.write_text(path.read_text() + json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: chat template failed: no$"):
        load_examples(path, strict)


def test_tokenize_rows_names_rows_by_index(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(DataError, match=r"^mem:2: missing field 'output' \(alpaca format\)$"):
        tokenize_rows([{"instruction": "I", "output": "O"}, {"instruction": "I"}], "alpaca", tokenizer, source="mem")
    with pytest.raises(DataError, match=r"^<rows>: no rows$"):
        tokenize_rows([], "text", tokenizer)


def test_missing_eos_token_is_a_user_error(tokenizer: PreTrainedTokenizerFast) -> None:
    no_eos = build_tokenizer(None)
    no_eos.eos_token = None
    with pytest.raises(UserError, match="no eos_token"):
        tokenize_rows([{"prompt": "Q", "completion": "A"}], "prompt_completion", no_eos)


def test_example_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Example(input_ids=(1, 2), labels=(1,))


# --- SlotStream ------------------------------------------------------------------------------------------------


def _examples(n: int) -> list[Example]:
    return [Example(input_ids=(i,), labels=(i,)) for i in range(n)]


def _ids(batch: list[Example]) -> list[int]:
    return [example.input_ids[0] for example in batch]


def test_same_seed_same_batches_whatever_the_global_rng() -> None:
    examples = _examples(10)
    first, second = SlotStream(examples, 3, seed=7), SlotStream(examples, 3, seed=7)
    random.seed(0)
    a = [_ids(first.next_batch()) for _ in range(8)]
    random.seed(1)
    random.random()
    b = [_ids(second.next_batch()) for _ in range(8)]
    assert a == b
    other = SlotStream(examples, 3, seed=8)
    assert [_ids(other.next_batch()) for _ in range(8)] != a


def test_every_epoch_is_a_fresh_permutation() -> None:
    stream = SlotStream(_examples(12), 4, seed=0)
    epochs = [sum((_ids(stream.next_batch()) for _ in range(3)), []) for _ in range(3)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    assert (stream.epoch, stream.position) == (3, 0)


def test_batches_wrap_across_epochs() -> None:
    stream = SlotStream(_examples(5), 3, seed=1)
    served = sum((_ids(stream.next_batch()) for _ in range(5)), [])  # 15 examples = 3 epochs
    assert all(len(batch) == 3 for batch in [served[i : i + 3] for i in range(0, 15, 3)])
    assert all(sorted(served[i : i + 5]) == list(range(5)) for i in (0, 5, 10))
    assert (stream.epoch, stream.position) == (3, 0)
    tiny = SlotStream(_examples(2), 5, seed=1)
    assert len(tiny.next_batch()) == 5
    assert (tiny.epoch, tiny.position) == (2, 1)


def test_state_dict_round_trip() -> None:
    examples = _examples(7)
    stream = SlotStream(examples, 3, seed=3)
    for _ in range(4):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))
    assert state == {"seed": 3, "epoch": 1, "position": 5, "num_examples": 7}
    resumed = SlotStream(examples, 3, seed=3)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()) for _ in range(6)] == [_ids(stream.next_batch()) for _ in range(6)]
    with pytest.raises(ValueError, match="seed 3 over 7 examples"):
        SlotStream(examples, 3, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 3 over 7 examples"):
        SlotStream(examples[:6], 3, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        resumed.load_state_dict({**state, "position": 7})


def test_stream_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one example"):
        SlotStream([], 2, seed=0)
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        SlotStream(_examples(3), 0, seed=0)


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        ('abc\tdef"}', "Invalid control character at column 204"),  # a raw tab at column 204
        ("abcdef", "Unterminated string starting at column 200"),  # a row cut off: where its last string starts
        ('abc",}', "Expecting property name enclosed in double quotes (column 206)"),  # a trailing comma
        ('ab\\qcd"}', "Invalid \\escape (column 203)"),
    ],
    ids=["tab", "cut-off", "trailing-comma", "bad-escape"],
)
def test_a_long_rows_json_error_names_its_column(tmp_path: Path, tail: str, message: str) -> None:
    """Issue 32: an error far into a long row is named at its column in the row (not column 1), for the training
    reader and the multiple-choice reader alike."""
    head = '{"prompt": "' + "x" * 170 + '", "completion": "'  # the completion's text starts at column 201
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + head + tail + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}:2: invalid JSON: {message}"


def test_a_byte_order_mark_inside_the_file_is_named(tmp_path: Path) -> None:
    """One at the start is accepted; one starting a later line (files joined together) is named, at its line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n')
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:2: invalid JSON: a byte-order mark (U+FEFF) starts the line")


def test_randomly_damaged_rows_are_one_line_each(tmp_path) -> None:
    """2,000 seeded files of damaged rows in every format, read under a random format, length bound and masking, with
    and without a chat template (a sample of ``python -m tests.damage rows``): each reads or is one ``UserError``
    line, within 5 s."""
    for path, run in itertools.islice(rows_cases(tmp_path, random.Random(0)), 2000):
        assert judge(run, 5.0) is None, path.read_text(errors="surrogateescape")
