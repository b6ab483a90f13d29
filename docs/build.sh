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

# mkdocstrings reads lora_sweep from source with griffe, which looks for a folder named lora_sweep (the checkout's
# root is the package's directory, whatever the clone is called) and skips a folder without __init__.py inside a
# regular package (griffe's loader: a namespace package there is "a user error"), as the seven package folders are
# (PEP 420: so they shadow no installed package). Its search path (mkdocs.yml: LORA_SWEEP_DOCS_PATH) holds
# lora_sweep/: links to the root's modules, and for each folder of pyproject.toml's packages a folder of links to
# its files with an empty __init__.py.
export LORA_SWEEP_DOCS_PATH="$ROOT/build/docs-path"
rm -rf "$LORA_SWEEP_DOCS_PATH"
mkdir -p "$LORA_SWEEP_DOCS_PATH/lora_sweep"
ln -s "$ROOT"/*.py "$LORA_SWEEP_DOCS_PATH/lora_sweep/"
for folder in $(python3 -c 'import tomllib; print(*(p.split(".")[1] for p in tomllib.load(open("pyproject.toml", "rb"))
                                                  ["tool"]["setuptools"]["packages"] if p.count(".") == 1))'); do
  mkdir "$LORA_SWEEP_DOCS_PATH/lora_sweep/$folder"
  ln -s "$ROOT/$folder"/* "$LORA_SWEEP_DOCS_PATH/lora_sweep/$folder/"
  touch "$LORA_SWEEP_DOCS_PATH/lora_sweep/$folder/__init__.py"
done

# The reference page is generated from the spec; a stale one is an error here as in tests/docs.
python3 docs/study_reference.py --check
if [ -n "${DOCS_DEMO_STUDY:-}" ]; then
  python3 docs/figure.py "$DOCS_DEMO_STUDY" --out docs/assets/demo-pareto.png
fi
SITE_DIR=$(realpath -m "${SITE_DIR:-$ROOT/build/site}")
python3 -m mkdocs build --strict --clean --config-file mkdocs.yml --site-dir "$SITE_DIR"
echo "site: $SITE_DIR/index.html"
