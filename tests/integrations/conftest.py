"""The training frameworks on the ringserve backend, against gloo (marker ``integrations``).

Each module runs a real framework, installed by the ``lightning``, ``hugging-face`` and
``deepspeed`` extras (scripts/test_integrations.sh installs them, pinned, and runs these tests).
A module whose framework is not installed is not collected; every test carries the
``integrations`` marker, deselected by default.
"""

from __future__ import annotations

import importlib.util

_NEEDS = {
    "test_lightning.py": ("lightning",),
    "test_hugging_face.py": ("accelerate", "transformers"),
    "test_deepspeed.py": ("deepspeed",),
}
collect_ignore = [name for name, modules in _NEEDS.items()
                  if any(importlib.util.find_spec(m) is None for m in modules)]
