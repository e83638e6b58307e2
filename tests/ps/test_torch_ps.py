"""ringserve.torch.ps.ParameterServerOptimizer on real shards and workers.

Each worker is a thread with a ringserve worker of its own (api.Context) on loopback, as a process
would be. In sync mode N workers end where one process does that steps on the mean of the N
batches' losses, and where allreduce-SGD does (each worker averaging its gradients with ringserve's
ring allreduce, then stepping torch's optimizer) -- with a learning-rate schedule, momentum, and
Adam over two parameter groups. async, ssp (overlapping a round with compute) and average train
a small task.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ringserve import Coordinator, api
from ringserve.config import CoordinatorConfig, PSClientConfig, ShardConfig, WorkerConfig
from ringserve.errors import UnsupportedError
from ringserve.loop import LoopThread
from ringserve.ps import ParameterServer
from ringserve.torch.ps import ParameterServerOptimizer

pytestmark = pytest.mark.timeout(120)

N = 3
STEPS = 6
FAST = dict(connect_timeout_s=5.0, rpc_timeout_s=5.0, use_uvloop=False)


_SEEDED = threading.Lock()


def model() -> torch.nn.Module:
    with _SEEDED:  # workers are threads here, and torch's seed is the process's
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam_groups": lambda m: torch.optim.Adam([{"params": m[0].parameters(), "lr": 1e-2},
                                               {"params": m[2].parameters()}], lr=3e-3),
}


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


@pytest.fixture
def job(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """A coordinator for N workers (or ``request.param``) and two shards in this process (shards
    serve one job in their life)."""
    n = getattr(request, "param", N)
    thread = LoopThread(use_uvloop=False, name="test-ps-coordinator")
    coord = thread.run(Coordinator(CoordinatorConfig(min_workers=n, max_workers=n, settle_s=0.05, tick_s=0.01,
                                                     heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0)).start(), 10)
    shards = ParameterServer(coord.address, shards=2, processes=False,
                             config=ShardConfig(max_wait_s=60.0, use_uvloop=False)).start()
    try:
        yield {"coordinator": coord.address}
    finally:
        shards.stop()
        thread.run(coord.stop(0.1), 10)
        thread.stop()


def on_workers(coordinator: str, fn: Callable[[api.Context], Any], n: int = N) -> list[Any]:
    """Runs ``fn(context)`` on n threads, each with its own worker; returns the results by rank."""
    def one(i: int) -> tuple[int, Any]:
        ctx = api.Context(WorkerConfig(coordinator=coordinator, rank_hint=i, rendezvous_timeout_s=30,
                                       collective_timeout_s=30, **FAST)).start()
        try:
            return ctx.worker.rank, fn(ctx)
        finally:
            ctx.close()

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n), timeout=100))
    return [r for _, r in sorted(results, key=lambda x: x[0])]


def client_config(coordinator: str) -> PSClientConfig:
    return PSClientConfig(coordinator=coordinator, round_timeout_s=30.0, shard_wait_s=20.0, **{
        k: v for k, v in FAST.items() if k != "use_uvloop"})


def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(x), y)


def reference(name: str) -> dict[str, torch.Tensor]:
    """One process stepping on the mean of the N batches' losses."""
    m = model()
    opt = OPTIMIZERS[name](m)
    sched = schedule(opt)
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.stack([loss_fn(m, *batch(r, step)) for r in range(N)]).mean()
        loss.backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sync_equals_one_process_on_the_mean_of_the_losses_and_allreduce_sgd(name: str, job: dict[str, str]) -> None:
    coordinator = job["coordinator"]

    def train(ctx: api.Context) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        rank = ctx.worker.rank
        m = model()
        opt = ParameterServerOptimizer(OPTIMIZERS[name](m), m, mode="sync", context=ctx,
                                       config=client_config(coordinator))
        sched = schedule(opt)
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(m, *batch(rank, step)).backward()
            opt.step()
            sched.step()
        opt.close()
        via_ps = {k: v.detach().clone() for k, v in m.state_dict().items()}
        # allreduce-SGD: ringserve's ring allreduce averages the gradients, torch steps.
        m2 = model()
        opt2 = OPTIMIZERS[name](m2)
        sched2 = schedule(opt2)
        for step in range(STEPS):
            opt2.zero_grad()
            loss_fn(m2, *batch(rank, step)).backward()
            for i, p in enumerate(m2.parameters()):
                grad = p.grad.numpy()
                p.grad = torch.from_numpy(ctx.call(lambda w, g=grad, i=i: w.allreduce(g, op="average", name=f"{name}.{i}")))
            opt2.step()
            sched2.step()
        return via_ps, {k: v.detach().clone() for k, v in m2.state_dict().items()}

    results = on_workers(coordinator, train)
    expected = reference(name)
    for via_ps, via_allreduce in results:
        for key, value in expected.items():
            torch.testing.assert_close(via_ps[key], value, rtol=2e-5, atol=2e-6)
            torch.testing.assert_close(via_allreduce[key], value, rtol=2e-5, atol=2e-6)
    for key in expected:   # and every worker holds the same model
        assert all(torch.equal(results[0][0][key], r[0][key]) for r in results)


def accuracy(m: torch.nn.Module) -> float:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 10, generator=g)
    with torch.no_grad():
        return float((m(x).argmax(1) == label(x)).float().mean())


def label(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.mark.parametrize(("mode", "kwargs"), [
    pytest.param("async", {}, marks=pytest.mark.slow),
    ("ssp", {"staleness": 1}),
    pytest.param("average", {"average_every": 4}, marks=pytest.mark.slow),
])
def test_each_mode_trains_a_small_classifier(mode: str, kwargs: dict[str, Any], job: dict[str, str]) -> None:
    coordinator = job["coordinator"]

    def train(ctx: api.Context) -> tuple[float, int, bool]:
        rank = ctx.worker.rank
        m = model()
        inner = torch.optim.Adam(m.parameters(), lr=3e-2)
        opt = ParameterServerOptimizer(inner, m, mode=mode, context=ctx, config=client_config(coordinator), **kwargs)
        g = torch.Generator().manual_seed(rank)
        for _ in range(80):
            x = torch.randn(32, 10, generator=g)
            opt.zero_grad()
            loss_fn(m, x, label(x)).backward()
            opt.step()
        opt.close()
        return accuracy(m), opt.rounds, opt._depth == 1

    results = on_workers(coordinator, train)
    for acc, rounds, overlapped in results:
        assert acc > 0.85, results
        assert rounds == (80 // kwargs.get("average_every", 1))
        assert overlapped == (mode in ("async", "ssp"))


def test_an_optimizer_the_shards_do_not_run_is_refused_naming_it_and_pointing_to_average_mode() -> None:
    m = model()
    with pytest.raises(UnsupportedError, match="not RMSprop; mode='average' steps any optimizer"):
        ParameterServerOptimizer(torch.optim.RMSprop(m.parameters()), m, mode="sync")


@pytest.mark.parametrize("job", [1], indirect=True)
def test_by_default_the_push_starts_in_backward_before_the_gradients_can_be_changed(job: dict[str, str]) -> None:
    def train(ctx: api.Context) -> bool:
        m = model()
        before = [p.detach().clone() for p in m.parameters()]
        opt = ParameterServerOptimizer(torch.optim.SGD(m.parameters(), lr=0.5), m, mode="sync", context=ctx,
                                       config=client_config(job["coordinator"]))
        loss_fn(m, *batch(0, 0)).backward()
        for p in m.parameters():
            p.grad.zero_()                      # too late: the push began when backward ended
        opt.step()
        opt.synchronize()
        opt.close()
        return any(not torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))

    assert on_workers(job["coordinator"], train, n=1) == [True]


@pytest.mark.parametrize("job", [1], indirect=True)
def test_with_push_at_step_a_zeroed_gradient_changes_nothing(job: dict[str, str]) -> None:
    def train(ctx: api.Context) -> bool:
        m = model()
        before = [p.detach().clone() for p in m.parameters()]
        opt = ParameterServerOptimizer(torch.optim.SGD(m.parameters(), lr=0.5), m, mode="sync", context=ctx,
                                       config=client_config(job["coordinator"]), push_in_backward=False)
        loss_fn(m, *batch(0, 0)).backward()
        for p in m.parameters():
            p.grad.zero_()
        opt.step()
        opt.synchronize()
        opt.close()
        return all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))

    assert on_workers(job["coordinator"], train, n=1) == [True]


@pytest.mark.parametrize("job", [1], indirect=True)
def test_backward_passes_per_step_push_the_accumulated_gradient_once(job: dict[str, str]) -> None:
    def train(ctx: api.Context) -> dict[str, torch.Tensor]:
        m = model()
        opt = ParameterServerOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, mode="sync", context=ctx,
                                       config=client_config(job["coordinator"]), backward_passes_per_step=2)
        for step in range(3):
            opt.zero_grad()
            for micro in range(2):
                loss_fn(m, *batch(micro, step)).backward()
            opt.step()
        opt.close()
        assert opt.client.versions == [3, 3]
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    got = on_workers(job["coordinator"], train, n=1)[0]
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            loss_fn(m, *batch(micro, step)).backward()
        opt.step()
    for key, value in m.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=2e-5, atol=2e-6)
