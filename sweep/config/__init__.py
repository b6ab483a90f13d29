"""The study file's layer: the typed spec (``spec``, ``_params``, ``strategy``), its YAML reader with overrides and
line-numbered errors (``loader``, ``_yaml``), foreign configs mapped onto it (``_foreign``: Axolotl, torchtune) and
the search space Optuna samples from (``space``). Validated once here; every layer below reads the typed spec."""
