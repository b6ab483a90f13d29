"""``python -m lora_sweep``: the ``sweep`` command line."""

from lora_sweep.cli import main

if __name__ == "__main__":
    main()
