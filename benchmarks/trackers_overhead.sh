#!/usr/bin/env bash
# The demo's wall time with and without the three trackers (issue 41: the trackers add < 1% to it).
# Runs `sweep run STUDY` PAIRS times each way, alternating (plain first, then trackers=[mlflow, wandb, tensorboard],
# all local: MLflow's SQLite store, W&B offline, TensorBoard files, in each run's own study directory), each into a
# fresh directory, and prints every wall time, the medians and their ratio. Run it on an otherwise idle machine:
# the trackers' thread shares the cores with training, and so does anything else running.
# Usage: benchmarks/trackers_overhead.sh [STUDY] [PAIRS]   (default: studies/demo.yaml 2; needs the mlflow, wandb
#        and tensorboard extras and the demo's model: sweep model smollm2 --out models/smollm2-135m)
# Writes into ${BENCH_OUT:-runs/bench-trackers}: plain-<i>/, trackers-<i>/ (the studies) and walls.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
study=${1:-studies/demo.yaml}
pairs=${2:-2}
out=${BENCH_OUT:-runs/bench-trackers}
rm -rf "$out"
mkdir -p "$out"
export WANDB_SILENT=true
run() {  # run NAME [OVERRIDE]: one timed `sweep run` into $out/NAME, its wall appended to walls.txt
  local start end
  start=$(date +%s.%N)
  python3 -m lora_sweep run "$study" --quiet --out "$out/$1" ${2:+"$2"} >"$out/$1.log" 2>&1
  end=$(date +%s.%N)
  echo "$1 $(python3 -c "print(f'{$end - $start:.1f}')")" | tee -a "$out/walls.txt"
}
for i in $(seq "$pairs"); do
  run "plain-$i"
  run "trackers-$i" "trackers=[mlflow, wandb, tensorboard]"
done
python3 - "$out/walls.txt" <<'PY'
import statistics, sys
walls = [line.split() for line in open(sys.argv[1])]
plain = statistics.median(float(w) for n, w in walls if n.startswith("plain"))
tracked = statistics.median(float(w) for n, w in walls if n.startswith("trackers"))
print(f"median wall: plain {plain:.1f} s, with the three trackers {tracked:.1f} s: {100 * (tracked / plain - 1):+.1f}%")
PY
