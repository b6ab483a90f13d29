"""The study file's layer: the typed spec (``spec``, ``settings``, ``sources``, ``strategy``, ``tracking``), its YAML
reader with overrides and line-numbered errors (``loader``, ``_yaml``), foreign configs mapped onto it (``_foreign``:
Axolotl, torchtune) and the trials its search space defines (``space``). Validated once here; every layer below
reads the typed spec."""
