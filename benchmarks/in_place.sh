# Sourced by the benchmark scripts: a checkout used in place, not pip-installed (the device machine's copy),
# imports as lora_sweep through a link named so (the checkout's root is the package's directory).
if ! python3 -c "import lora_sweep" 2>/dev/null; then
  _lora_sweep_link=$(mktemp -d)
  ln -s "$PWD" "$_lora_sweep_link/lora_sweep"
  export PYTHONPATH="$_lora_sweep_link${PYTHONPATH:+:$PYTHONPATH}"
fi
