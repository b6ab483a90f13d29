#!/usr/bin/env bash
# Issues 28 and 38's speed check in one command: benchmarks/sweep_split.sh on the same study five ways — as written,
# with gradient accumulation (micro-batch 4 x 2, the same effective batch), with sample packing, and with LoRA dropout
# 0 and 0.05 on every trial (the study searches both) — then one table:
# command wall, its ratio to the plain study's, GPU busy (whole command / after the load), train and evaluate
# seconds, and the training step each pack ran (`sweep run`'s log line per pack).
# Usage: benchmarks/sweep_split_variants.sh [CONFIG_DIR] [OVERRIDES...]
#   e.g. benchmarks/sweep_split_variants.sh train.max_steps=150 'pruning.rungs=[40]'   (after `sweep model smollm2`)
# Writes into ${BENCH_OUT:-runs/bench-variants}/{plain,accumulation,packing}/ (sweep_split.sh's files).
set -o pipefail
cd "$(dirname "$0")/.."
root=${BENCH_OUT:-runs/bench-variants}
mkdir -p "$root"
variants="plain accumulation packing no-dropout dropout"
declare -A extra=([plain]="" [accumulation]="train.micro_batch=4 train.gradient_accumulation_steps=2"
                  [packing]="train.sample_packing=true" [no-dropout]="search.dropout=[0.0]"
                  [dropout]="search.dropout=[0.05]")
for v in $variants; do
  echo "== $v: $* ${extra[$v]}"
  # shellcheck disable=SC2086  # the variant's overrides are words
  BENCH_OUT=$root/$v benchmarks/sweep_split.sh "$@" ${extra[$v]} > "$root-$v.log" 2>&1
  mkdir -p "$root/$v" && mv "$root-$v.log" "$root/$v/split.log"
  tail -n 4 "$root/$v/split.log"
done
python3 - "$root" $variants <<'PY'
import json, pathlib, re, sys
root = pathlib.Path(sys.argv[1])
rows, plain = [], None
for v in sys.argv[2:]:
    log = (root / v / "split.log").read_text()
    wall = re.search(r"command wall s: ([\d.]+)", log)
    busy = re.search(r"gpu util mean ([\d.]+)%", log)
    after = re.search(r"gpu util after the load, .*?: ([\d.]+)%", log)
    run_log = (root / v / "run.log").read_text() if (root / v / "run.log").is_file() else ""
    steps = sorted(set(re.findall(r"trained on the (\S+) step", run_log))) or ["?"]
    try:
        phases = json.loads((root / v / "timing.json").read_text())["runs"][-1]["phases"]
    except (OSError, ValueError, KeyError, IndexError):
        phases = {}
    w = float(wall.group(1)) if wall else float("nan")
    plain = w if v == "plain" else plain
    rows.append((v, w, w / plain if plain else float("nan"), busy.group(1) if busy else "?",
                 after.group(1) if after else "?", phases.get("train", float("nan")),
                 phases.get("evaluate", float("nan")), ",".join(steps)))
print("| variant | command wall s | x plain | GPU busy % (whole / after load) | train s | evaluate s | step |")
print("|---|---|---|---|---|---|---|")
for v, w, x, b, a, t, e, s in rows:
    print(f"| {v} | {w:.1f} | {x:.2f}x | {b} / {a} | {t:.1f} | {e:.1f} | {s} |")
for v in sys.argv[2:]:
    log = root / v / "run.log"
    for why in re.findall(r"capture failed, trained eagerly: (.*)", log.read_text() if log.is_file() else ""):
        print(f"{v}: a pack trained eagerly: {why}")
walls = {v: w for v, w, *_ in rows}
if walls.get("no-dropout"):
    print(f"dropout 0.05 / dropout 0: {walls['dropout'] / walls['no-dropout']:.2f}x command wall")
PY
