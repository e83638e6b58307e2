"""The benchmark charts the docs show are drawn from committed results, by benchmarks/plots.py.

plots.py runs here on benchmarks/results/ into a temporary folder: it must draw a chart for every
result file, and the docs must show exactly the charts it draws (none missing, none stale). The
SVG bytes are not compared: another matplotlib version draws the same figure differently.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CHARTS = ROOT / "docs" / "benchmarks" / "charts"
PLOTS = ROOT / "benchmarks" / "plots.py"
CHART_OF = {"allreduce.json": "allreduce-busbw.svg", "training_step.json": "training-step.svg", "wan.json": "wan.svg",
            "wan_target.json": "wan-target.svg"}


def draw(results: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PLOTS), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=100)


def shown_in_docs() -> set[str]:
    """The chart files that a docs page shows as an image."""
    names: set[str] = set()
    for page in (ROOT / "docs").rglob("*.md"):
        names |= set(re.findall(r"\]\((?:\.\./)*(?:benchmarks/)?charts/([A-Za-z0-9_.-]+\.svg)\)", page.read_text()))
    return names


def test_plots_draws_a_chart_for_every_committed_result_and_the_docs_show_each_one(tmp_path: Path) -> None:
    done = draw(RESULTS, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    drawn = {p.name for p in tmp_path.glob("*.svg")}
    expected = {chart for name, chart in CHART_OF.items() if (RESULTS / name).exists()}
    expected |= {f"failover-{p.stem}.svg" for p in (RESULTS / "failover").glob("*.json")}
    expected |= {"scale-sim.svg"} if (RESULTS / "scale" / "scale-sim.json").exists() else set()
    assert drawn == expected, f"plots.py drew {sorted(drawn)}, expected {sorted(expected)}"
    assert {p.name for p in CHARTS.glob("*.svg")} == drawn, "docs/benchmarks/charts differs from what the results draw: run benchmarks/plots.py"
    missing = drawn - shown_in_docs()
    assert not missing, f"no docs page shows {sorted(missing)}"
    for svg in tmp_path.glob("*.svg"):
        assert svg.stat().st_size > 10_000 and svg.read_text().lstrip().startswith("<?xml"), svg.name


def test_every_committed_result_says_when_and_on_what_machine_it_was_measured() -> None:
    records = [*RESULTS.glob("*.json"), *(RESULTS / "failover").glob("*.json")]
    assert records, "no benchmark results are committed"
    for path in records:
        record = json.loads(path.read_text())
        assert re.match(r"\d{4}-\d\d-\d\dT", record.get("date", "")), f"{path.name}: no date"
        machine = record.get("machine", {})
        assert machine.get("cores") and machine.get("load_average"), f"{path.name}: no machine or load"


def test_plots_refuses_a_folder_without_results(tmp_path: Path) -> None:
    done = draw(tmp_path, tmp_path / "charts")
    assert done.returncode != 0 and "no results" in done.stderr


def test_a_missing_result_is_skipped_with_a_note(tmp_path: Path) -> None:
    name = "wan.json"
    (tmp_path / "results").mkdir()
    others = [p for p in RESULTS.glob("*.json") if p.name != name]
    for p in others:
        (tmp_path / "results" / p.name).write_text(p.read_text())
    done = draw(tmp_path / "results", tmp_path / "charts")
    assert done.returncode == 0 and f"skipped {name}" in done.stdout, done.stdout + done.stderr
