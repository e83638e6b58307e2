"""The generated code in ringserve/_proto is what scripts/generate_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "scripts" / "generate_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("generate_protos", module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_generated_code_matches_a_fresh_generation_from_the_protos(tmp_path: pathlib.Path) -> None:
    written = load_generator().generate(tmp_path)
    assert written, "the generator wrote nothing"
    committed_dir = ROOT / "ringserve" / "_proto"
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in committed_dir.glob("*_pb2*")}
    assert sorted(fresh) == sorted(committed), "generated and committed files differ by name"
    stale = [name for name in sorted(fresh) if fresh[name] != committed[name]]
    assert not stale, f"ringserve/_proto is stale ({', '.join(stale)}): run python scripts/generate_protos.py"


def test_the_generated_modules_import_each_other_from_the_package() -> None:
    for path in (ROOT / "ringserve" / "_proto").glob("*.py"):
        assert "from ringserve.v1 import" not in path.read_text(), path.name
