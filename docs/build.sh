#!/usr/bin/env bash
# Build the documentation site strictly: a warning (a broken link or anchor, a missing API object, a snippet file
# not found) fails the build. Writes build/site/. Needs the docs extra: pip install -e ".[docs]".
#   docs/build.sh                        the study-file reference must be current, then mkdocs build --strict
#   SITE_DIR=DIR docs/build.sh           the site in DIR instead of build/site
#   DOCS_DEMO_STUDY=runs/demo docs/build.sh   first redraw docs/assets/demo-pareto.png from that study directory
#                                        (the one `sweep run studies/demo.yaml` writes)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

# mkdocstrings reads lora_sweep from source: the checkout's root is the package's directory, whatever the clone
# is called, so a folder holding one link named lora_sweep is its search path (mkdocs.yml: LORA_SWEEP_DOCS_PATH).
export LORA_SWEEP_DOCS_PATH="$ROOT/build/docs-path"
mkdir -p "$LORA_SWEEP_DOCS_PATH"
ln -sfn "$ROOT" "$LORA_SWEEP_DOCS_PATH/lora_sweep"

# The reference page is generated from the spec; a stale one is an error here as in tests/docs.
python3 docs/study_reference.py --check
if [ -n "${DOCS_DEMO_STUDY:-}" ]; then
  python3 docs/figure.py "$DOCS_DEMO_STUDY" --out docs/assets/demo-pareto.png
fi
SITE_DIR=$(realpath -m "${SITE_DIR:-$ROOT/build/site}")
python3 -m mkdocs build --strict --clean --config-file mkdocs.yml --site-dir "$SITE_DIR"
echo "site: $SITE_DIR/index.html"
