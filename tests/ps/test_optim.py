"""The shards' optimizers step as torch.optim's do: a sync step equals torch's on the mean gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.errors import InvalidArgumentError
from ringserve.ps import optim

CASES = {
    "sgd": (optim.Optimizer(kind="sgd", lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_wd": (optim.Optimizer(kind="sgd", lr=0.05, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01)),
    "momentum": (optim.Optimizer(kind="momentum", lr=0.1, momentum=0.9),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "dampening": (optim.Optimizer(kind="momentum", lr=0.1, momentum=0.8, dampening=0.3),
                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, dampening=0.3)),
    "nesterov": (optim.Optimizer(kind="momentum", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (optim.Optimizer(kind="adam", lr=1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "adam_wd": (optim.Optimizer(kind="adam", lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
                lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ten_steps_match_torch_optim(case: str, dtype: type) -> None:
    ours, make = CASES[case]
    rng = np.random.default_rng(1)
    start = rng.standard_normal(257).astype(dtype)
    grads = [rng.standard_normal(257).astype(dtype) for _ in range(10)]
    values, state = start.copy(), optim.State()
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    reference = make([param])
    for g in grads:
        values = optim.step(ours, values, g, state)
        param.grad = torch.from_numpy(g.copy())
        reference.step()
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(values, param.detach().numpy(), **tolerance)
    assert values.dtype == dtype


def test_a_step_returns_new_values_and_leaves_the_old_array_as_it_was() -> None:
    values = np.ones(4, np.float32)
    new = optim.step(optim.Optimizer(kind="sgd", lr=1.0), values, np.ones(4, np.float32), optim.State())
    assert (values == 1).all() and (new == 0).all()


def test_a_learning_rate_given_with_the_step_overrides_the_optimizers() -> None:
    new = optim.step(optim.Optimizer(kind="sgd", lr=1.0), np.ones(2), np.ones(2), optim.State(), lr=0.25)
    np.testing.assert_allclose(new, [0.75, 0.75])


def test_float16_values_step_in_float32_and_stay_float16() -> None:
    values = np.full(3, 1.0, np.float16)
    new = optim.step(optim.Optimizer(kind="adam", lr=1e-3), values, np.full(3, 0.5, np.float32), optim.State())
    assert new.dtype == np.float16 and (new < 1).all()


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(kind="lbfgs"), "'lbfgs' is not one"),
    (dict(kind="sgd", lr=-1.0), r"learning rate \(-1.0\)"),
    (dict(kind="momentum", momentum=0.0), r"momentum \(0.0\)"),
    (dict(kind="sgd", momentum=0.5), "takes no momentum"),
    (dict(kind="adam", beta1=1.0), r"beta1 \(1.0\)"),
    (dict(kind="adam", eps=0.0), r"eps \(0.0\)"),
    (dict(kind="momentum", momentum=0.9, nesterov=True, dampening=0.1), "Nesterov"),
])
def test_a_bad_optimizer_is_refused_naming_the_setting(kwargs: dict, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        optim.Optimizer(**kwargs)
