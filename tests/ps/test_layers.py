"""The shards stand on the ground: only ps/api.py (the synchronous client) and the package's
re-exports reach up to the worker. tests/unit/test_import_layers.py places ringserve.ps as a whole
above the numpy facade, for that client; this holds the rest of the package to the ground."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

UNIT = pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_import_layers.py"
CLIENT_SIDE = {"ringserve.ps", "ringserve.ps.api"}


def load_layers() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("import_layers_for_ps", UNIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_shard_side_of_ringserve_ps_imports_only_the_ground_the_wire_contract_and_itself() -> None:
    layers = load_layers()
    allowed = layers.reachable("ground")
    found = []
    for module, targets in sorted(layers.graph().items()):
        if not module.startswith("ringserve.ps.") or module in CLIENT_SIDE:
            continue
        for target, line in sorted(targets.items()):
            own = target.startswith("ringserve.ps.") and target not in CLIENT_SIDE
            if not own and layers.layer_of(target) not in allowed:
                found.append(f"{module}:{line} imports {target} ({layers.layer_of(target)})")
    assert not found, "the shard side reaches above the ground:\n" + "\n".join(found)


def test_the_shard_side_is_not_empty_so_the_check_above_checks_something() -> None:
    shard_side = [m for m in load_layers().graph() if m.startswith("ringserve.ps.") and m not in CLIENT_SIDE]
    assert {"ringserve.ps.shard", "ringserve.ps.service", "ringserve.ps.store", "ringserve.ps.client"} <= set(shard_side)
