"""The import graph of ringserve/ has no cycles, and no import runs back up the layers.

Every import statement counts: at the top of a module, inside a function (a lazy import), or under
``if TYPE_CHECKING:``. A cycle hidden in a function or behind TYPE_CHECKING still ties two modules
into one, which is what the rule is there to prevent.

The layers are those of CONTRIBUTING.md ("The layers"), from the wire contract up to the engines. A module
belongs to the layer of its longest matching prefix; it may import its own layer and the layers
that its layer stands on (``below``, followed transitively). Siblings (the coordinator and the
worker, the framework bindings) stand on the same ground and never import each other. A new
package names its layer here (CONTRIBUTING.md says where things go).
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ringserve"


@dataclass(frozen=True)
class Layer:
    prefixes: tuple[str, ...]
    below: tuple[str, ...]  # the layers this one stands on (each with what stands below it)
    exact: tuple[str, ...] = ()  # modules of this layer by their name alone (a package's __init__)


GROUND = tuple(
    f"ringserve.{name}"
    for name in ("errors", "config", "constants", "wire", "codecs", "ring", "commits", "security", "transport",
                 "handshake", "observe", "metrics", "loop", "_malloc", "_lazy", "atomic", "powersgd", "topology", "selection")
)

LAYERS: dict[str, Layer] = {
    "wire contract": Layer(("ringserve._proto",), ()),
    "ground": Layer(GROUND, ("wire contract",)),
    "coordinator": Layer(("ringserve.coordinator",), ("ground",)),
    "data plane": Layer(("ringserve.worker.dataplane",), ("ground",)),
    "collectives": Layer(("ringserve.worker.ops",), ("data plane",)),
    "control loops": Layer(("ringserve.worker.control",), ("collectives",)),
    "worker node and faces": Layer(("ringserve.worker",), ("control loops",)),
    # DiLoCo on numpy arrays: the facade's collectives, driven by an optimizer's schedule.
    "numpy facade": Layer(("ringserve.api", "ringserve.diloco"), ("worker node and faces",)),
    "elastic": Layer(("ringserve.elastic",), ("numpy facade",)),
    # The shards and the asyncio client, and what they share, stand on the ground alone: a shard
    # process loads neither the worker nor the coordinator.
    "parameter servers": Layer(("ringserve.ps",), ("ground",)),
    # The synchronous client is a worker of the numpy facade's context, whose id and view it pushes as.
    # (The client package's __init__ re-exports it, so it sits here too.)
    "parameter-server client": Layer(("ringserve.ps.client.sync",), ("numpy facade", "parameter servers"),
                                     exact=("ringserve.ps.client",)),
    # What the framework bindings share, with no framework in it (topology, ops, fused collectives,
    # errors carried through graph ops).
    "binding core": Layer(("ringserve.bindings", "ringserve.bridge", "ringserve.graph_ops"), ("elastic",)),
    "torch binding": Layer(("ringserve.torch",), ("binding core", "coordinator", "parameter-server client")),
    "keras binding": Layer(("ringserve.keras",), ("binding core", "coordinator")),
    "tensorflow binding": Layer(("ringserve.tensorflow",), ("binding core", "coordinator")),
    "engines": Layer(
        ("ringserve.launch", "ringserve.spark", "ringserve.ray", "ringserve.cli", "ringserve.healthcheck",
         "ringserve.testing"),
        # The estimators and Ray Train run a framework's training through its binding: the engines
        # stand on every binding (and the bindings, siblings, never on each other).
        ("elastic", "coordinator", "parameter-server client", "torch binding", "keras binding", "tensorflow binding"),
    ),
    # The packages' own __init__s that re-export public names of every layer (ringserve, and
    # ringserve.ps, whose ParameterServer supervisor sits with the launchers). Lazily: see ringserve/_lazy.py.
    "package": Layer((), ("engines",), exact=("ringserve", "ringserve.ps")),
}


def layer_of(module: str) -> str:
    best, length = "", -1
    for name, layer in LAYERS.items():
        if module in layer.exact:
            return name
        for prefix in layer.prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > length:
                best, length = name, len(prefix)
    assert best, f"{module} belongs to no layer: name its layer in tests/unit/test_import_layers.py"
    return best


def reachable(name: str) -> set[str]:
    """The layers ``name`` may import: itself and everything it stands on."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(LAYERS[current].below)
    return seen


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> dict[str, int]:
    """The ringserve modules ``module`` imports, each with the line of its first import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            # ``from ringserve.worker import runtime`` imports the module runtime, not the package.
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "exports":
            # A lazy re-export table (ringserve/_lazy.py): each module it names is imported on first read.
            table = node.args[1] if len(node.args) > 1 else None
            if isinstance(table, ast.Dict):
                targets = [v.value for v in table.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        for named in targets:
            target = named
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != module:
                found.setdefault(target, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {module: imports(module, path, known) for module, path in known.items()}


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_of_ringserve_has_no_cycle_even_through_lazy_or_type_checking_imports() -> None:
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, targets in sorted(graph().items()):
        mine = layer_of(module)
        allowed = reachable(mine)
        for target, line in sorted(targets.items()):
            theirs = layer_of(target)
            if theirs not in allowed:
                upward.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_checker_sees_lazy_and_type_checking_imports_and_finds_their_cycles(tmp_path: pathlib.Path) -> None:
    # The checker itself must be able to fail: a hidden cycle of three, and a function-level import.
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(edges) == [["a", "b", "c"]]
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ringserve.api import init\n"
        "def f():\n    from ringserve.worker import runtime\n"
        "from . import ring\n"
    )
    known = {"ringserve.errors": PACKAGE / "errors.py", "ringserve.api": PACKAGE / "api.py",
             "ringserve.worker.runtime": PACKAGE / "worker" / "runtime.py", "ringserve.ring": PACKAGE / "ring.py"}
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    found = imports("ringserve.errors", probe, known)
    assert found == {"ringserve.api": 3, "ringserve.worker.runtime": 5, "ringserve.ring": 6}
    assert layer_of("ringserve.worker.dataplane.plane") == "data plane"
    assert layer_of("ringserve.worker.runtime") == "worker node and faces"
    assert "worker node and faces" not in reachable("data plane")
    assert "coordinator" not in reachable("worker node and faces")
    assert "torch binding" not in reachable("keras binding")
