"""The fuzz campaign (benchmarks/fuzz.py) in the default suite: 300 inputs at each port of a live
job (coordinator, peer streams, payload lanes, fd-passing sockets, a parameter-server shard, the
status page), with no crash, hang, unactionable answer or stall; and its inputs drawn from the seed
alone, so that any one can be sent again. The full run (100,000 a surface) is documented in
docs/deploy/security.md."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fuzz  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_300_inputs_at_every_port_of_a_live_job_crash_hang_and_stall_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fuzz.py"), "--inputs", "300", "--seed", "7",
                           "--json", str(report_path), "--workdir", str(tmp_path / "target")],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert set(report["surfaces"]) == set(fuzz.SURFACES)
    for surface, row in report["surfaces"].items():
        assert (row["crashes"], row["hangs"], row["faults"], row["stalls"]) == (0, 0, 0, 0), (surface, row)
        assert sum(row["outcomes"].values()) >= 300, (surface, row["outcomes"])
        assert row["peak_rss_mib"] > 0
    # The refusals were the servers' own, by name: the inputs reached them.
    assert report["surfaces"]["coordinator"]["outcomes"].get("INVALID_ARGUMENT", 0) > 0
    assert report["surfaces"]["coordinator"]["outcomes"].get("UNAUTHENTICATED", 0) > 0
    assert any(k.startswith("HTTP 4") for k in report["surfaces"]["status"]["outcomes"])
    assert report["job"]["collectives"] > 0 and report["job"]["pushes"] > 0


def test_an_input_is_drawn_from_the_seed_surface_and_index_alone() -> None:
    def draw(seed: int, surface: str, index: int) -> list[bytes]:
        rng = random.Random(f"{seed}:{surface}:{index}")
        return [fuzz.coordinator_message(rng, "Join"), fuzz.lane_bytes(rng)[0], fuzz.peer_message(rng),
                fuzz.status_request(rng, "t", "127.0.0.1:1")]

    assert draw(1, "x", 5) == draw(1, "x", 5)
    assert draw(1, "x", 5) != draw(1, "x", 6) and draw(1, "x", 5) != draw(2, "x", 5)
