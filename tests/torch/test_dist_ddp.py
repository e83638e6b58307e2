"""DDP over ringserve trains to DDP over gloo's parameters: same seeds, same data, same steps.

One world per backend and size runs every scenario in turn (workers/dist_ddp.py): plain DDP (with
a BatchNorm, whose buffers DDP broadcasts), the fp16, bf16 and PowerSGD comm hooks, no_sync
gradient accumulation, ZeroRedundancyOptimizer, find_unused_parameters and static_graph. ringserve
alone adds int8 compression with error feedback, chosen by pg_options on a new_group of every rank.
Where torch sees a GPU, both backends train again on it (DDP with device_ids), and compare there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _dist_worlds import DIST_WORKERS, run_dist
from _worlds import DEVICES, device_env

sys.path.insert(0, str(DIST_WORKERS))
import dist_ddp

SCENARIOS = ["plain", "fp16_hook", "bf16_hook", "powersgd", "no_sync", "zero", "unused", "static", "int8"]
# Float sums in another order (world 4: the rings add in different orders), then 6 steps of SGD.
EXACT = dict(rtol=1e-5, atol=1e-6)
TOLERANCE = {
    "fp16_hook": dict(rtol=1e-3, atol=1e-4),    # both add float16 values, rounded at each partial sum
    "bf16_hook": dict(rtol=1e-2, atol=1e-3),
    "powersgd": dict(rtol=1e-4, atol=1e-5),     # low-rank factors orthogonalized after each reduction
    "int8": dict(rtol=2e-2, atol=5e-3),         # against gloo's uncompressed run
}
Results = Callable[[str, int], list[dict[str, Any]]]


@pytest.fixture(scope="module", params=DEVICES)
def trained(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Results]:
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    device = request.param

    def get(backend: str, n: int) -> list[dict[str, Any]]:
        if (backend, n) not in runs:
            out = tmp_path_factory.mktemp(f"ddp_{backend}{n}_{device}")
            run_dist(DIST_WORKERS / "dist_ddp.py", n, out, [backend, *SCENARIOS], timeout_s=300,
                     env=device_env(device))
            ranks = sorted((torch.load(out / f"rank{r}.pt") for r in range(n)), key=lambda x: x["rank"])
            for r in ranks:
                for scenario, seen in r["devices"].items():
                    assert {d.split(":")[0] for d in seen} == {device}, f"{backend} {scenario}: {seen}"
            runs[backend, n] = ranks
        return runs[backend, n]

    yield get


def _parameters(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The trained parameters (BatchNorm's running statistics are each rank's own)."""
    return {k: v for k, v in result.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def _check_equivalence(trained: Results, n: int, scenario: str) -> None:
    gloo, ours = trained("gloo", n), trained("ringserve", n)
    assert [r["backend"] for r in ours] == ["ringserve"] * n and [r["size"] for r in ours] == [n] * n
    expected = gloo[0]["results"]["plain" if scenario == "int8" else scenario]
    got = ours[0]["results"][scenario]
    tolerance = TOLERANCE.get(scenario, EXACT)
    for key, value in expected.items():
        if key.startswith("zero."):
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6)
            continue
        torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m, k=key: f"{scenario} {k}: {m}")
    torch.manual_seed(0)
    initial = dist_ddp.Net(switch=scenario == "unused").state_dict()
    assert not torch.allclose(got["head.weight"], initial["head.weight"]), f"{scenario} did not train"


def _check_identical(trained: Results, n: int) -> None:
    ours = trained("ringserve", n)
    for scenario in SCENARIOS:
        first = _parameters(ours[0]["results"][scenario])
        for other in ours[1:]:
            for key, value in first.items():
                if key.startswith("zero."):
                    continue
                assert torch.equal(value, other["results"][scenario][key]), (
                    f"{scenario}: {key} differs between rank 0 and rank {other['rank']}"
                )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_over_ringserve_trains_to_the_parameters_of_ddp_over_gloo_at_world_2(trained: Results, scenario: str) -> None:
    _check_equivalence(trained, 2, scenario)


@pytest.mark.timeout(600)
def test_every_rank_of_ddp_over_ringserve_ends_with_bit_identical_parameters_at_world_2(trained: Results) -> None:
    _check_identical(trained, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_over_ringserve_trains_to_the_parameters_of_ddp_over_gloo_at_world_4(trained: Results, scenario: str) -> None:
    _check_equivalence(trained, 4, scenario)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_rank_of_ddp_over_ringserve_ends_with_bit_identical_parameters_at_world_4(trained: Results) -> None:
    _check_identical(trained, 4)
