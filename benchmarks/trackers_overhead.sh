#!/usr/bin/env bash
# The demo's wall time with and without the three trackers (issue 41: the trackers add < 1% to it).
# Runs `sweep run STUDY` PAIRS times each way, alternating (plain first, then trackers=[mlflow, wandb, tensorboard],
# all local: MLflow's SQLite store, W&B offline, TensorBoard files, in each run's own study directory), each into a
# fresh directory, and prints every wall time, the medians and their ratio, and per tracked run the CPU seconds the
# trackers say they used (their process, and its children: W&B's core), a bound on what they took from training
# that the noise of wall times does not blur. Run it on an otherwise idle machine: the trackers' process shares the
# cores with training, and so does anything else running.
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
python3 - "$out" <<'PY'
import re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
walls = [line.split() for line in (out / "walls.txt").read_text().splitlines()]
plain = statistics.median(float(w) for n, w in walls if n.startswith("plain"))
tracked = statistics.median(float(w) for n, w in walls if n.startswith("trackers"))
print(f"median wall: plain {plain:.1f} s, with the three trackers {tracked:.1f} s: {100 * (tracked / plain - 1):+.1f}%")
# what the trackers say they cost (sweep.trackers.sync): CPU in their process and in W&B's core process
for name, wall in walls:
    if name.startswith("trackers"):
        said = re.search(r"trackers: (\d+) passes; CPU ([\d.]+) s in their process \(([\d.]+) s preparing, ([\d.]+) s "
                         r"after the run\), ([\d.]+) s in its child", (out / f"{name}.log").read_text())
        if said:
            passes, own, prepared, after, children = said[1], *(float(x) for x in said.groups()[1:])
            during = own - prepared - after + children
            print(f"{name}: {passes} passes, CPU {own:.2f} s in their process ({prepared:.2f} s preparing, {after:.2f} s "
                  f"after the run) + {children:.2f} s in its children (W&B's core): {during:.2f} s between preparing "
                  f"and the run's end, {100 * during / float(wall):.2f}% of its {wall} s wall")
PY
