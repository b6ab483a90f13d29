#!/usr/bin/env bash
# Issue 20's H200 measurements, one command: QLoRA (a Llama-3-70B-shaped NF4 base with 8 slots; Llama-3-8B NF4
# against bf16; the step captured over NF4) and sample packing on short instruction rows (0.5B shape).
# Run from the repository root on the GPU machine: benchmarks/training_features_gpu.sh [OUT_DIR]
# Needs torchao (the qlora extra); each part has its own time limit, so one that stalls leaves the others.
# Each part prints one JSON line per run into OUT_DIR/<part>.jsonl; a table of all of them comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
# lora_sweep is imported as installed: in a checkout, pip install -e . first (the root is the package directory).
out=${1:-${OUT:-/tmp/training-features}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python -c "import torch, triton, transformers, torchao; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())" 2>&1 \
  | grep -v "Failed to load\|_pytree" | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/versions.txt"

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > >(tee "$out/$name.jsonl") 2> "$out/$name.err"
  echo "   rc=$? in $((SECONDS - start))s"
  grep -v "Failed to load\|_pytree\|register_constant" "$out/$name.err" | tail -n 3
}

q=benchmarks/qlora_bench.py
part qlora-70b-nf4 125 python $q --shape llama3-70b --quantize nf4 --slots 8 --seq 512 --activation-checkpointing \
  --warmup 2 --steps 2
part qlora-8b-nf4 35 python $q --shape llama3-8b --quantize nf4 --slots 8 --seq 512
part qlora-8b-bf16 35 python $q --shape llama3-8b --quantize none --slots 8 --seq 512
part packing-0.5b 55 python -m lora_sweep.benchmarks.packing_bench --shape qwen2.5-0.5b --slots 8 --micro 16 --row-len 512 \
  --steps 6 --warmup 2
part qlora-8b-nf4-graph 40 python $q --shape llama3-8b --quantize nf4 --slots 8 --seq 512 --graph

python - "$out" <<'EOF'
import json, pathlib, sys
rows = [json.loads(l) for f in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")) for l in f.read_text().splitlines()
        if l.startswith("{")]
print(f"{'run':44} {'base GiB':>8} {'peak GiB':>8} {'step s':>7} {'tok/s':>8} {'MFU':>6} {'grad GiB':>8} {'pad':>6}")
for r in rows:
    if "shape" in r and "quantize" in r:
        name = f"{r['shape']} {r['quantize']} x{r['slots']}{' AC' if r['activation_checkpointing'] else ''}" \
               f"{' graph' if r['graph'] else ''}"
        if "error" in r:
            print(f"{name:44} error: {r['error']}")
            continue
        print(f"{name:44} {r['base_gib']:8.2f} {r['peak_gib']:8.2f} {r['step_s']:7.3f} {r['tokens_per_s']:8d} "
              f"{r['mfu']:6.3f} {r['adapter_grad_gib']:8.3f} {'':>6}")
    else:
        name = f"packing {r['shape']} {r['mode']} ({r['examples_per_step']} examples/step)"
        print(f"{name:44} {'':>8} {'':>8} {r['step_ms'] / 1e3:7.3f} {r['tok_s']:8d} {'':>6} {'':>8} "
              f"{r['padding']:6.3f}")
EOF
