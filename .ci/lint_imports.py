"""``lint-imports`` for this checkout: import-linter's command with grimp told how to name a namespace package.

The contracts' root packages are the seven folders, ``lora_sweep.sweep`` ... ``lora_sweep.benchmarks``: namespace
packages (no ``__init__.py``), which grimp takes as roots but names after the path of their directory, as if it
were ``.../lora_sweep/sweep`` (grimp 3.20, ``ModuleFinder._namespace_from_dir``). Here that directory is
``<clone>/sweep``, so grimp would call the root ``<clone's parent>.<clone>.sweep`` and every contract would miss
it. The finder below names a namespace directory from the package's name and its path inside the package.
``python .ci/lint_imports.py`` takes lint-imports' arguments (``--contract acyclic``, ``--no-cache``).
"""

from __future__ import annotations

import os
import sys

from grimp.adaptors.modulefinder import ModuleFinder
from grimp.application.config import settings


class NamespaceFinder(ModuleFinder):
    """grimp's module finder, naming a namespace directory ``<package>.<its path inside the package>``."""

    def _namespace_from_dir(self, package_name: str, namespace_dir: str, package_directory: str) -> str:
        inside = os.path.relpath(namespace_dir, package_directory)
        return package_name if inside == "." else ".".join([package_name, *inside.split(os.sep)])


settings.configure(MODULE_FINDER=NamespaceFinder())

if __name__ == "__main__":
    from importlinter.cli import lint_imports_command

    sys.exit(lint_imports_command())
