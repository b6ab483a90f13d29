#!/usr/bin/env bash
# The demo's wall time with and without the three trackers (issue 41: the trackers add < 1% to it).
# Runs `sweep run STUDY` PAIRS times each way, alternating (plain first, then trackers=[mlflow, wandb, tensorboard],
# all local: MLflow's SQLite store, W&B offline, TensorBoard files, in each run's own study directory), each into a
# fresh directory, and prints every wall time, the medians and their ratio, and per tracked run the CPU seconds the
# trackers say they used (their process, and its children: W&B's core), a bound on what they took from training
# that the noise of wall times does not blur, and the CPU seconds of each run's own process: a run slowed with the
# same work in more CPU seconds ran slower on its cores (a busier host, its caches), one slowed in as many waited.
# Run it on an otherwise idle machine: the trackers' process shares the cores with training, and so does anything
# else running.
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
run() {  # run NAME [OVERRIDE]: one timed `sweep run` into $out/NAME; its wall and CPU seconds appended to walls.txt
  python3 - "$out" "$1" "$study" ${2:+"$2"} <<'PY' | tee -a "$out/walls.txt"
import resource, subprocess, sys, time
out, name, study, *override = sys.argv[1:]
start = time.monotonic()
with open(f"{out}/{name}.log", "w") as log:
    subprocess.run([sys.executable, "-m", "lora_sweep", "run", study, "--quiet", "--out", f"{out}/{name}", *override],
                   stdout=log, stderr=subprocess.STDOUT, check=False)
used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run's process (the trackers' outlives it: not counted)
print(f"{name} {time.monotonic() - start:.1f} {used.ru_utime + used.ru_stime:.1f}")
PY
}
for i in $(seq "$pairs"); do
  run "plain-$i"
  run "trackers-$i" "trackers=[mlflow, wandb, tensorboard]"
done
python3 - "$out" <<'PY'
import statistics, sys
from pathlib import Path
from lora_sweep.benchmarks.trackers_pinned import said_cost
out = Path(sys.argv[1])
walls = [line.split() for line in (out / "walls.txt").read_text().splitlines()]
median = {kind: [statistics.median(float(r[i]) for r in walls if r[0].startswith(kind)) for i in (1, 2)]
          for kind in ("plain", "trackers")}
(plain, plain_cpu), (tracked, tracked_cpu) = median["plain"], median["trackers"]
print(f"median wall: plain {plain:.1f} s, with the three trackers {tracked:.1f} s: {100 * (tracked / plain - 1):+.1f}%")
print(f"median CPU of the run's process: plain {plain_cpu:.1f} s, with the trackers {tracked_cpu:.1f} s "
      f"({100 * (tracked_cpu / plain_cpu - 1):+.1f}%)")
pairs = [(a, b) for a, b in zip(walls[::2], walls[1::2])]
print("pairs (wall, CPU of the run's process): " + ", ".join(
    f"{100 * (float(b[1]) / float(a[1]) - 1):+.1f}% / {100 * (float(b[2]) / float(a[2]) - 1):+.1f}%" for a, b in pairs))
# what the trackers say they cost (sweep.trackers.sync): CPU in their process and in W&B's core process
for name, wall, _ in walls:
    if name.startswith("trackers") and (c := said_cost((out / f"{name}.log").read_text())):
        print(f"{name}: {c['passes']:.0f} passes, CPU {c['own']:.2f} s in their process ({c['prepared']:.2f} s "
              f"preparing, {c['after']:.2f} s after the run) + {c['children']:.2f} s in its children (W&B's core): "
              f"{c['during']:.2f} s between preparing and the run's end, {100 * c['during'] / float(wall):.2f}% of its "
              f"{wall} s wall")
PY
