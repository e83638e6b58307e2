"""torchft beside ringserve (marker ``torchft``, deselected by default; scripts/bench_torchft.sh --test).

The module needs the benchmark-only ``torchft`` extra; where it is not installed, the module is not
collected (as tests/integrations does for its frameworks).
"""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torchft") is not None else ["test_vs_torchft_round.py"]
