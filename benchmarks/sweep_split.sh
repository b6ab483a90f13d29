#!/usr/bin/env bash
# A whole `sweep run` on one GPU with its wall-time split (issue 18): studies/demo-gpu.yaml on SmolLM2-135M's shape.
# With models/smollm2-135m (the real model: `sweep model smollm2 --out models/smollm2-135m`) it runs on that;
# otherwise pass a directory holding SmolLM2's config.json and tokenizer files (e.g. what `sweep model` wrote,
# minus the weights) and a random-init model of that config (bf16, seed 0) is built into models/smollm2-135m-random.
# nvidia-smi samples the GPU's utilisation every 0.5 s while the run goes; the run prints its split (load,
# compile/capture, train, evaluate, save, storage) and this script prints the wall time and the GPU busy share,
# and the command's wall outside the split: before the run (imports, from lora_sweep's) and after it (the
# report, exit), and the GPU busy share after the model load.
# Bytecode: before the clock, the packages' .pyc files are compiled where missing (`compileall` of the folders
# holding the packages a sweep imports, and of this repository), as a default `pip install` leaves them; an
# install with --no-compile otherwise makes the timed run compile every module it imports first (~11 s before
# training starts on a 2-core CPU VM, ~4 s more for the report). BENCH_COLD_BYTECODE=1 skips this and measures
# that cold case.
# Triton's kernel cache ($LORA_SWEEP_CACHE/triton/..., or $TRITON_CACHE_DIR) is what it is: warm after a first run here.
# BENCH_COLD_TRITON=1 points TRITON_CACHE_DIR at a new empty folder, to time a machine's first run.
# BENCH_WRAP prefixes the timed command, e.g. BENCH_WRAP="py-spy record -f raw -o spy.txt --" to profile it.
# Usage: benchmarks/sweep_split.sh [CONFIG_DIR] [OVERRIDES...]   e.g. ... cfg train.max_steps=150 'pruning.rungs=[40]'
# Writes into ${BENCH_OUT:-runs/bench-split}: run.log, gpu_util.txt, timing.json, status.txt.
set -o pipefail
cd "$(dirname "$0")/.."
# lora_sweep is imported as installed: in a checkout, pip install -e . first (the root is the package directory).
out=${BENCH_OUT:-runs/bench-split}
mkdir -p "$out"
model=$PWD/models/smollm2-135m
if [ ! -f "$model/config.json" ]; then
  model=$PWD/models/smollm2-135m-random
  python3 - "$1" "$model" <<'PY' || exit 1
import pathlib, shutil, sys
import torch, transformers
src, dst = (pathlib.Path(p) for p in sys.argv[1:])
if not (dst / "model.safetensors").is_file():
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(src)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, dst / f.name)
print("random-init model of", src / "config.json", "in", dst)
PY
fi
[ $# -gt 0 ] && [ -d "$1" ] && shift
if [ -z "$BENCH_COLD_BYTECODE" ]; then
  # the folders holding the packages a sweep imports (the device's carried wheels sit apart from torch's)
  site=$(python3 -c "import importlib.util as u, os; print(' '.join(sorted({os.path.dirname(os.path.dirname(s.origin)) for s in map(u.find_spec, ('torch', 'transformers', 'optuna', 'sqlalchemy', 'sqlite_utils', 'plotly', 'scipy')) if s and s.origin})))")
  python3 -m compileall -q -j 0 $site __init__.py kernels packer evaluators sweep reports > /dev/null 2>&1
  echo "bytecode: compiled where missing in $site and the repository (BENCH_COLD_BYTECODE=1: left to the run)"
fi
if [ -n "$BENCH_COLD_TRITON" ]; then
  export TRITON_CACHE_DIR=$(mktemp -d)
  echo "triton cache: empty ($TRITON_CACHE_DIR), as on a machine's first run"
fi
python3 -c "import torch, transformers, triton, peft; print(torch.__version__, transformers.__version__, triton.__version__, peft.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 > "$out/gpu_util.txt" &
smi=$!
start=$(date +%s.%N)
$BENCH_WRAP python3 -m lora_sweep run studies/demo-gpu.yaml "model.path=$model" "$@" --out "$out/run" --quiet > "$out/run.log" 2>&1
rc=$?
wall=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
kill $smi
cp "$out/run/timing.json" "$out/" 2>/dev/null
python3 -m lora_sweep status "$out/run" > "$out/status.txt" 2>&1
sed -n '/ complete, /,$p' "$out/run.log"
echo "sweep run rc $rc, command wall s: $wall"
python3 - "$out/timing.json" "$wall" "$out/gpu_util.txt" <<'PY' 2>/dev/null
import json, sys
run = json.load(open(sys.argv[1]))["runs"][-1]
before = run.get("process_before_s")
if before is not None:
    print(f"outside the split: {before:.1f} s before it, {float(sys.argv[2]) - before - run['wall_s']:.1f} s after it "
          f"(the split starts at the process's start: source {run.get('source', 'run')})")
    # the samples (every 0.5 s from the command's start) from the end of the load to the end of the run
    util = [float(x) for x in open(sys.argv[3]).read().split()]
    ph = run["phases"]
    t0, t1 = before + ph.get("import", 0) + ph.get("read", 0) + ph["load"], before + run["wall_s"] - ph.get("report", 0)
    window = [u for i, u in enumerate(util) if t0 <= i * 0.5 < t1]
    if window:
        print(f"gpu util after the load, {t0:.1f}-{t1:.1f} s of the command: {sum(window) / len(window):.1f}% "
              f"({len(window)} samples)")
PY
awk '{s+=$1; n++; if ($1>0) b++} END {printf "gpu util mean %.1f%% (nvidia-smi, %d of %d samples > 0)\n", s/n, b, n}' "$out/gpu_util.txt"
