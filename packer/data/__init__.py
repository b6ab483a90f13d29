"""Rows and batches: the training formats and their reader (``rows``), chat templates (``chat``), sample packing
(``packing``) and the padded, slot-grouped batch (``batch``).

The names below are what the floors above read data with (``packer.api.data``): the light modules' (``rows``,
``lines``, ``stream``: no torch), so that checking a study's data files loads no torch. ``batch`` and ``packing``
are the step's, imported where it builds batches.
"""

from lora_sweep.packer.data.lines import iter_lines, line_bound
from lora_sweep.packer.data.packing import SamplePackedStream
from lora_sweep.packer.data.rows import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    IGNORE_INDEX,
    Example,
    SlotStream,
    json_error,
    load_examples,
    read_jsonl,
    tokenize_rows,
)
from lora_sweep.packer.data.stream import adapter_stream, epoch_steps, row_lengths, stream_tokens, target_tokens

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "FORMATS", "IGNORE_INDEX", "Example", "SamplePackedStream",
           "SlotStream", "adapter_stream", "epoch_steps", "iter_lines", "json_error", "line_bound", "load_examples",
           "read_jsonl", "row_lengths", "stream_tokens", "target_tokens", "tokenize_rows"]
