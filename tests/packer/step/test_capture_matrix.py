"""Every configuration a sweep can reach trains on the cuda-graph step (marked gpu: CUDA graphs exist only there).

A capture that fails falls back to the same step run eagerly, which is slower, and says so in one warning; this
matrix makes such a fallback a test failure instead: every tiny model family with LoRA dropout, and on Llama the
fused base ops on and off, eager and SDPA attention, gradient accumulation, sample packing, activation
checkpointing and QLoRA's NF4 base. Each trains two slots for three steps (one with dropout, one accumulating
where asked) in bf16 and must end with ``TrainResult.step == "cuda-graph"`` and no ``fallback``; the message of a
failure is the fallback's own line (the configuration, the error and the line that raised it). On the CPU the
fallback's reporting is checked instead: a forced failure names the configuration and the cause.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from lora_sweep.packer.data.packing import SamplePackedStream
from lora_sweep.packer.data.rows import SlotStream
from lora_sweep.packer.model.load import load_base
from lora_sweep.packer.model.packed import PackedModel
from lora_sweep.packer.plan import AdapterSpec
from lora_sweep.packer.step import loop
from lora_sweep.packer.step.train import SlotJob, TrainResult, train
from lora_sweep.packer.tiny.models import FAMILIES, build_tiny_model
from tests.conftest import need_triton, random_examples

need_triton()

TARGETS = ("all-linear",)


def _train(model_dir: Path, *, attn: str | None = None, fused: bool = True, accumulate: int = 1,
           packing: bool = False, checkpointing: bool = False, chunked: bool = False,
           quantize: str | None = None) -> tuple[TrainResult, str, list[str]]:
    """Two slots, three steps on ``model_dir`` in bf16 on CUDA; ``attn`` None: the model's default attention (SDPA
    where the family has it, eager where not), as a study loads it. Returns the result, the attention used and the
    capture-failure warnings raised."""
    model, _ = load_base(str(model_dir), attn_implementation=attn, dtype="bfloat16", device="cuda",
                         quantize=quantize)
    pm = PackedModel(model, fused_base_ops=fused)
    examples = random_examples(64, seed=0, vocab=model.config.vocab_size, min_len=12, max_len=40)
    jobs = []
    for i, (dropout, k) in enumerate(((0.1, 1), (0.0, accumulate))):
        spec = AdapterSpec(rank=4 + 4 * i, alpha=8, lr=1e-3, micro_batch=2, targets=TARGETS, max_steps=3, seed=i,
                           dropout=dropout, gradient_accumulation_steps=k, sample_packing=packing)
        stream = SamplePackedStream(examples, 2, i, 96) if packing else SlotStream(examples, 2, i)
        jobs.append(SlotJob(spec, stream, key=i))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(pm, 2, lambda slot: jobs.pop(0) if jobs else None, pad_id=0, chunked_ce=chunked,
                       activation_checkpointing=checkpointing)
    fallbacks = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    return result, model.config._attn_implementation, fallbacks


EAGER_MASK_CAPTURES = Version(transformers.__version__) >= Version("5.21")
"""transformers 5.17-5.20 build eager attention's additive mask with ``torch.tensor(0.0, device=...)``
(``masking_utils.eager_mask``): a host scalar copied to the GPU, which a capture refuses; 5.21 makes it there."""


CANNOT_CAPTURE = {"falcon": "modeling_falcon.py", "gpt_neo": "modeling_gpt_neo.py"}
"""Families whose own attention copies a host tensor to the GPU on every call (docs/guides/training.md's table):
Falcon indexes its fused QKV with Python lists, GPT-Neo builds its mask value with ``torch.tensor``."""


def _assert_captured(run: tuple[TrainResult, str, list[str]], family: str = "llama") -> None:
    """Captured, with no fallback warning; or one of the documented exceptions (docs/guides/training.md), where the
    one warning and ``fallback`` name that cause: eager attention before transformers 5.21, ``CANNOT_CAPTURE``."""
    result, attn, fallbacks = run
    assert fallbacks == ([] if result.fallback is None else
                         [f"CUDA graph capture failed, training eagerly: {result.fallback}"]), fallbacks
    cause = CANNOT_CAPTURE.get(family)
    if attn == "eager" and not EAGER_MASK_CAPTURES:  # the mask is built first: its copy fails the capture first
        cause = "masking_utils.py:"
    if cause is not None:
        assert result.step == "eager" and result.fallback is not None, result
        assert cause in result.fallback, result.fallback
        return
    assert result.fallback is None, result.fallback
    assert result.step == "cuda-graph" and result.graphs > 0, result


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_with_dropout_trains_on_the_cuda_graph_step(family: str, tmp_path: Path) -> None:
    _assert_captured(_train(build_tiny_model(family, tmp_path, seed=0)), family)


LLAMA_CASES = {
    "sdpa, fused base": {"attn": "sdpa"},
    "sdpa, base ops eager": {"attn": "sdpa", "fused": False},
    "eager attention, fused base": {"attn": "eager"},
    "eager attention, base ops eager": {"attn": "eager", "fused": False},
    "gradient accumulation": {"accumulate": 2},
    "sample packing": {"packing": True},
    "sample packing, eager attention": {"packing": True, "attn": "eager"},
    "activation checkpointing": {"checkpointing": True},
    "chunked loss": {"chunked": True},
    "activation checkpointing, accumulation, packing, chunked loss": {"checkpointing": True, "accumulate": 2,
                                                                      "packing": True, "chunked": True},
    "qlora nf4": {"quantize": "nf4"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_every_llama_configuration_trains_on_the_cuda_graph_step(case: str, llama: Path) -> None:
    options = LLAMA_CASES[case]
    if options.get("quantize") and importlib.util.find_spec("torchao") is None:
        pytest.skip("QLoRA needs torchao (the qlora extra)")
    _assert_captured(_train(llama, **options))


def test_a_failed_capture_is_one_warning_naming_the_configuration_and_the_cause(
        llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU no graph is captured; with graphs forced on and the capture made to fail the way transformers
    5.17's eager mask did (a host scalar copied under capture), the run trains eagerly, ``TrainResult.fallback``
    names the model, its attention, the switches on and the error with the line that raised it, and the one
    warning says the same."""

    def failing_capture(fn, **_kwargs):  # noqa: ANN001, ANN202
        def copy_under_capture() -> None:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                               "tensor is pinned")
        copy_under_capture()

    monkeypatch.setattr(loop, "capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    with pytest.warns(UserWarning, match="CUDA graph capture failed") as caught:
        result = _train_cpu(llama, graphs=loop.Graphs(enabled=True))  # graphs on, on the CPU
    assert result.step == "eager" and result.graphs == 0
    assert result.fallback is not None
    assert result.fallback.startswith("LlamaForCausalLM (sdpa attention, base ops eager, ")
    assert "gradient accumulation" in result.fallback and "chunked loss" in result.fallback
    assert "RuntimeError: Cannot copy between CPU and CUDA tensors" in result.fallback
    assert "test_capture_matrix.py:" in result.fallback and "in copy_under_capture" in result.fallback
    assert [str(w.message) for w in caught if "capture failed" in str(w.message)] == [
        f"CUDA graph capture failed, training eagerly: {result.fallback}"]


def _train_cpu(model_dir: Path, **options: object) -> TrainResult:
    """``_train`` on the CPU in fp32 with the torch ops (no interpreter: only the fallback is under test)."""
    model, _ = load_base(str(model_dir), attn_implementation="sdpa", device="cpu")
    pm = PackedModel(model, impl="torch")
    examples = random_examples(64, seed=0, vocab=model.config.vocab_size, min_len=12, max_len=40)
    spec = AdapterSpec(rank=4, alpha=8, lr=1e-3, micro_batch=2, targets=TARGETS, max_steps=2, seed=0,
                       gradient_accumulation_steps=2)
    jobs = [SlotJob(spec, SlotStream(examples, 2, 0), key=0)]
    return train(pm, 1, lambda slot: jobs.pop(0) if jobs else None, pad_id=0, chunked_ce=True,
                 **options)  # type: ignore[arg-type]
