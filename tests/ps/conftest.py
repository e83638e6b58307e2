"""tests/ps: the parameter server. psworlds.py builds its worlds."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
