"""Chat rows through a chat template: the conversation rendered, split into prompt text and assistant turns, and
tokenized, so ``packer.data.rows`` can train the assistant turns only.

A tokenizer's own ``chat_template`` is used where it has one, ``PLAIN_CHAT_TEMPLATE`` otherwise. Turns are located
by rendering each prefix of the conversation (``_split_turns``), which needs a template that renders a prefix as a
prefix of the whole; ``encode`` and ``eos_id`` are the two tokenizer calls every row format makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError

from lora_sweep.errors import DataError, UserError

__all__ = ["PLAIN_CHAT_TEMPLATE", "Piece", "chat_pieces", "encode", "eos_id"]

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\\n\\n' }}{% endif %}Assistant: {% endif %}"
)
"""Chat rendering for tokenizers without a ``chat_template``: ``Role: content`` blocks separated by a blank line,
each assistant turn closed by EOS. The tokenizer adds its own special tokens (e.g. BOS) in front, as for alpaca
rows; a generation prompt ends with ``Assistant: ``."""

# A piece of a tokenized row: token ids, and whether they are response tokens (trained by default).
Piece = tuple[list[int], bool]


def chat_pieces(messages: list[dict[str, Any]], tokenizer: Any, train_on_prompt: bool, where: str) -> list[Piece]:
    """Render a conversation, split it into prompt text and assistant turns, and tokenize each piece."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        eos_id(tokenizer)  # PLAIN_CHAT_TEMPLATE closes assistant turns with EOS

    def render(upto: int, generation_prompt: bool) -> str:
        if upto == 0:
            return ""  # apply_chat_template refuses an empty conversation: an opening assistant turn is all trained
        try:
            rendered: str = tokenizer.apply_chat_template(
                messages[:upto],
                chat_template=None if template else PLAIN_CHAT_TEMPLATE,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except (TemplateError, ValueError, TypeError) as err:
            raise DataError(f"{where}: chat template failed: {err}") from None
        return rendered

    texts = _split_turns(messages, render)
    if texts is None:
        if not train_on_prompt:
            raise DataError(
                f"{where}: the chat template does not render conversation prefixes as prefixes of the whole, "
                "so assistant turns cannot be located; set train_on_prompt to train on every token"
            )
        texts = [(render(len(messages), False), True)]  # spans only matter for masking
    # A chat template writes its own special tokens (HF tokenizes its output without adding any); the plain
    # fallback has none, so its first piece gets the tokenizer's (e.g. BOS), like an alpaca prompt.
    pieces = [
        (encode(tokenizer, text, special=not template and k == 0), trained) for k, (text, trained) in enumerate(texts)
    ]
    return [piece for piece in pieces if piece[0]]


def _split_turns(messages: list[dict[str, Any]], render: Callable[[int, bool], str]) -> list[tuple[str, bool]] | None:
    """Split the rendered conversation into (text, is_assistant_turn) pieces; None if the template can't be split.

    Assistant turn ``i`` spans from the end of ``render(i, generation_prompt=True)`` to the end of
    ``render(i + 1, generation_prompt=False)``: its content plus whatever the template closes the turn with (e.g.
    EOS). This needs a template that renders each prefix of a conversation as a prefix of the whole rendering.
    """
    full = render(len(messages), False)
    texts: list[tuple[str, bool]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, turn = render(i, True), render(i + 1, False)
        if len(prompt) < cursor or not turn.startswith(prompt) or not full.startswith(turn):
            return None
        texts += [(full[cursor : len(prompt)], False), (full[len(prompt) : len(turn)], True)]
        cursor = len(turn)
    return [*texts, (full[cursor:], False)]


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text``, with the tokenizer's special tokens (e.g. BOS) if ``special``."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def eos_id(tokenizer: Any) -> int:
    """The EOS id every trained response ends with; a tokenizer without one is a user error."""
    eos: int | None = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no eos_token; set one so the model learns where a response ends")
    return eos
