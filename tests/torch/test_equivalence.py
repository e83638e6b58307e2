"""N ranks with DistributedOptimizer train to the parameters of one process on the whole batch.

One world per size runs every scenario (each rank on 1/N of every batch); the reference runs here,
in this process, on the whole batch. Where torch sees a GPU, the worlds train again on it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _worlds import DEVICES, WORKERS, device_env, run_world

sys.path.insert(0, str(WORKERS))
import equivalence

SCENARIOS = ["sgd", "momentum", "adam", "bpps2", "predivide", "sum", "fp16", "bf16", "unused", "int8", "nonfinite", "nonfinite_int8"]
# Compression rounds every gradient on the wire: fp16 to 11 bits, bf16 to 8, int8 to a 254th of
# each block's largest value (with error feedback, what is lost comes back in the next step).
TOLERANCE = {"fp16": dict(rtol=1e-2, atol=1e-3), "bf16": dict(rtol=2e-2, atol=5e-3), "int8": dict(rtol=2e-2, atol=5e-3),
             "nonfinite_int8": dict(rtol=2e-2, atol=5e-3)}
EXACT = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", params=DEVICES)
def trained(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Callable[[int], list[dict[str, Any]]]]:
    """Runs every scenario once per world size, on first use; returns each rank's saved results."""
    runs: dict[int, list[dict[str, Any]]] = {}
    device = request.param

    def get(n: int) -> list[dict[str, Any]]:
        if n not in runs:
            out = tmp_path_factory.mktemp(f"equivalence{n}_{device}")
            run_world(WORKERS / "equivalence.py", n, out, SCENARIOS, timeout_s=150, env=device_env(device))
            runs[n] = sorted((torch.load(out / f"rank{r}.pt") for r in range(n)), key=lambda x: x["rank"])
            for r in runs[n]:
                assert r["devices"] == {s: [device] for s in SCENARIOS}, (device, r["devices"])
        return runs[n]

    yield get


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_n_ranks_train_to_the_parameters_of_one_process_on_the_whole_batch(
    trained: Callable[[int], list[dict[str, Any]]], n: int, scenario: str
) -> None:
    ranks = trained(n)
    assert [r["size"] for r in ranks] == [n] * n
    expected = equivalence.reference(scenario, n)
    got = ranks[0]["results"][scenario]
    tolerance = TOLERANCE.get(scenario, EXACT)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m, k=key: f"{scenario} {k}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_ends_with_bit_identical_parameters(trained: Callable[[int], list[dict[str, Any]]], n: int) -> None:
    ranks = trained(n)
    for scenario in SCENARIOS:
        first = ranks[0]["results"][scenario]
        for other in ranks[1:]:
            for key, value in first.items():
                assert torch.equal(value, other["results"][scenario][key]), (
                    f"{scenario}: {key} differs between rank 0 and rank {other['rank']}"
                )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
def test_parameters_some_ranks_skip_are_trained_and_those_no_rank_uses_are_left_alone(
    trained: Callable[[int], list[dict[str, Any]]], n: int
) -> None:
    initial = equivalence._model().state_dict()
    got = trained(n)[0]["results"]["unused"]
    assert not torch.equal(got["extra.weight"], initial["extra.weight"]), "the sometimes-used head did not train"
    # weight_decay would have shrunk it, had it been given a zero gradient instead of none
    assert torch.equal(got["never.weight"], initial["never.weight"])
    assert torch.equal(got["never.bias"], initial["never.bias"])
