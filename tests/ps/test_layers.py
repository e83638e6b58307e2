"""The shards and the asyncio client stand on the ground: tests/unit/test_import_layers.py places
ringserve.ps in the "parameter servers" layer, on the ground alone, and only the synchronous
client (ps/client/sync.py, a worker of the numpy facade) and the packages' re-exports above it.
This checks that those placements hold the whole shard side, so that the general rule covers it.
(A shard process's modules, as loaded: tests/unit/test_lazy_imports.py.)"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

UNIT = pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_import_layers.py"
ABOVE = {"ringserve.ps": "package", "ringserve.ps.client": "parameter-server client",
         "ringserve.ps.client.sync": "parameter-server client"}


def load_layers() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("import_layers_for_ps", UNIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_parameter_server_module_but_the_synchronous_client_lies_in_a_layer_on_the_ground_alone() -> None:
    layers = load_layers()
    assert layers.reachable("parameter servers") == {"parameter servers", "ground", "wire contract"}
    placed = {m: layers.layer_of(m) for m in layers.graph() if m == "ringserve.ps" or m.startswith("ringserve.ps.")}
    assert {m: layer for m, layer in placed.items() if layer != "parameter servers"} == ABOVE
    shard_side = {m for m, layer in placed.items() if layer == "parameter servers"}
    assert {"ringserve.ps.shard.node", "ringserve.ps.shard.service", "ringserve.ps.shard.store",
            "ringserve.ps.client.aio", "ringserve.ps.jobs"} <= shard_side
