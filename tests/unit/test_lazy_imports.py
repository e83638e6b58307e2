"""A light ``import ringserve``: packages re-export their names lazily (ringserve/_lazy.py), and each
kind of process loads only its own layers.

- ``import ringserve`` loads no layer (not the worker, the coordinator, grpc or numpy) until a name
  is read;
- every lazily exported name resolves, and each package's table says what its ``TYPE_CHECKING``
  imports say (the copy type checkers read);
- a real coordinator, a real shard and a real numpy worker, each its own process, load only the
  layers of tests/unit/test_import_layers.py that they stand on (``python -X importtime`` lists
  every module a process imports, as it imports it).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import test_import_layers  # the layer table, beside this file

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ["ringserve", "ringserve.ps", "ringserve.ps.client", "ringserve.ps.shard", "ringserve.coordinator",
                 "ringserve.elastic", "ringserve.launch"]
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", re.M)

pytestmark = pytest.mark.timeout(120)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def test_import_ringserve_loads_no_layer_no_grpc_and_no_numpy() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, json, ringserve; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, env=env(), timeout=60).stdout
    loaded = set(json.loads(out))
    assert {m for m in loaded if m.startswith("ringserve")} == {"ringserve", "ringserve._lazy", "ringserve.errors"}
    assert not loaded & {"grpc", "numpy", "google.protobuf", "torch"}


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_lazy_name_resolves_and_the_table_matches_the_type_checking_imports(package: str) -> None:
    module = importlib.import_module(package)
    path = pathlib.Path(module.__file__ or "")
    tree = ast.parse(path.read_text())
    table: dict[str, str] = {}
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "exports":
            assert isinstance(node.args[1], ast.Dict)
            table = {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.args[1].keys, node.args[1].values, strict=True)
                     if k is not None}
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module
                checked.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    assert table and table == checked, f"{package}: the lazy table and its TYPE_CHECKING imports differ"
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reported a process importing."""
    return set(IMPORTED.findall(stderr))


def own_layers(found: set[str], table: types.ModuleType) -> set[str]:
    return {table.layer_of(m) for m in found if m == "ringserve" or m.startswith("ringserve.")}


def wait_for(proc: subprocess.Popen[str], text: str, timeout_s: float) -> str:
    """The first line of ``proc``'s stdout holding ``text``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return line
        assert line or proc.poll() is None, f"the process ended without {text!r}"
    raise AssertionError(f"no line with {text!r} within {timeout_s} s")


def spawn(args: list[str], err: pathlib.Path) -> subprocess.Popen[str]:
    """``args`` as a process, its stdout a pipe (the line or two it says), its stderr the file ``err``:
    ``-X importtime`` writes a line there per module (over 20 KiB before the first line on stdout),
    and a pipe read only at the end holds 64 KiB: a child blocked on it would never say that line."""
    with err.open("w") as sink:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=sink, text=True, env=env())


def stop(proc: subprocess.Popen[str], err: pathlib.Path) -> str:
    """Stops ``proc`` (SIGTERM, then SIGKILL) and returns its stderr, from ``err``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    return err.read_text()


def test_a_coordinator_a_shard_and_a_numpy_worker_each_load_only_their_own_layers(tmp_path: pathlib.Path) -> None:
    table = test_import_layers
    python = [sys.executable, "-X", "importtime"]
    coordinator_err, shard_err = tmp_path / "coordinator.err", tmp_path / "shard.err"
    coordinator = spawn([*python, "-m", "ringserve.cli", "coordinator", "--port", "0", "--min-workers", "1",
                         "--settle-seconds", "0.2"], coordinator_err)
    procs = [coordinator]
    try:
        address = wait_for(coordinator, "listening on", 60).split("listening on", 1)[1].split()[0]
        shard = spawn([*python, "-m", "ringserve.cli", "ps", "--one-shard", "--shards", "1", "--coordinator", address],
                      shard_err)
        procs.append(shard)
        wait_for(shard, "serving on", 60)
        script = tmp_path / "worker.py"
        script.write_text("import numpy as np\nimport ringserve as rs\nrs.init()\n"
                          "assert (rs.allreduce(np.ones(4)) == 1).all()\nrs.shutdown()\nprint('done', flush=True)\n")
        worker = subprocess.run([*python, str(script)], capture_output=True, text=True, timeout=90,
                                env={**env(), "RINGSERVE_COORDINATOR": address})
        assert worker.returncode == 0 and "done" in worker.stdout, worker.stderr[-3000:]
        shard_loaded = imported(stop(shard, shard_err))
        coordinator_loaded = imported(stop(coordinator, coordinator_err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    engines = {"engines", "package"}  # the CLI that started each (the coordinator's and the shard's)
    assert own_layers(coordinator_loaded, table) <= {"wire contract", "ground", "coordinator", *engines}, (
        own_layers(coordinator_loaded, table))
    assert own_layers(shard_loaded, table) <= {"wire contract", "ground", "parameter servers", *engines}, (
        own_layers(shard_loaded, table))
    # The CLI's engine modules, not the launcher: a shard loads launch.shards (its supervisor's
    # serve) and none of the coordinator that `ringserve run` starts.
    assert not {m for m in shard_loaded if m.startswith(("ringserve.coordinator", "ringserve.worker", "ringserve.api"))}
    assert own_layers(imported(worker.stderr), table) == {
        "wire contract", "ground", "data plane", "collectives", "control loops", "worker node and faces", "numpy facade",
        "package"}
