"""DiLoCo on a real world of three processes (workers/diloco.py): with H = 1 and a plain outer
SGD it is synchronous averaging; in every configuration the global copy is the same bytes on every
rank after every step, and it moves only when a sync lands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _worlds import DEVICES, WORKERS, device_env, run_world

N = 3

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=DEVICES)
def ranks(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp(f"diloco_{request.param}")
    run_world(WORKERS / "diloco.py", N, out, timeout_s=150, env=device_env(request.param))
    ranks = sorted((torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)), key=lambda r: r["rank"])
    assert {r["device"].split(":")[0] for r in ranks} == {request.param}
    return ranks


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_diloco_with_h1_and_a_plain_outer_sgd_of_lr_1_is_synchronous_averaging(
    ranks: list[dict[str, Any]], inner: str,
) -> None:
    """global - (global - mean(local)) is mean(local) up to one rounding of the global copy."""
    for r in ranks:
        got, expected, initial = r[f"h1_{inner}"]["diloco"], r[f"h1_{inner}"]["reference"], r[f"h1_{inner}"]["initial"]
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            assert not torch.equal(value, initial[key]), f"{key} did not train"


@pytest.mark.parametrize("label", ["int8", "fragments", "fp16_two_fragments", "module_fragments"])
def test_the_global_copy_is_the_same_bytes_on_every_rank_after_every_step(
    ranks: list[dict[str, Any]], label: str,
) -> None:
    traces = [r[f"trace.{label}"] for r in ranks]
    for other in traces[1:]:
        assert other["global"] == traces[0]["global"], f"{label}: the global copies differ between ranks"
        assert other["outer"] == traces[0]["outer"]
    first = traces[0]
    # It changes exactly at the steps where an outer step landed, and every sync landed.
    for step in range(1, len(first["global"])):
        moved = first["global"][step] != first["global"][step - 1]
        assert moved == (first["outer"][step] > first["outer"][step - 1]), (label, step)
    assert first["outer"][-1] >= 3
    # The ranks train on their own data: their local parameters differ between syncs.
    assert traces[0]["local"][0] != traces[1]["local"][0]


def test_with_one_fragment_and_no_blend_every_rank_adopts_the_global_copy_at_each_outer_step(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        t = r["trace.int8"]
        for step, (g, local, outer) in enumerate(zip(t["global"], t["local"], t["outer"], strict=True)):
            if step and outer > t["outer"][step - 1]:
                assert local == g, f"step {step}: the local parameters are not the new global copy"
        assert set(t["in_flight"]) == {0}  # no delay: each sync lands at the step it starts


def test_fragments_with_a_delay_keep_one_sync_in_flight_over_an_inner_step(ranks: list[dict[str, Any]]) -> None:
    t = ranks[0]["trace.fragments"]
    assert 1 in t["in_flight"] and max(t["in_flight"]) == 1
    assert t["outer"][-1] == 6  # fragments start at steps 2, 4, 6, ... and land one step later


def test_the_numpy_diloco_keeps_its_global_copy_the_same_bytes_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    shas = [r["numpy"] for r in ranks]
    assert all(s == shas[0] for s in shas)
    assert len(set(shas[0])) == 4  # the start, then after each of the three syncs (steps 3, 6, 9)
