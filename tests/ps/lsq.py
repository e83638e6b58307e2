"""A small least-squares task for the parameter-server tests: each rank holds its own samples."""

from __future__ import annotations

import numpy as np

DIM = 12
TRUE_W = np.linspace(-1, 1, DIM).astype(np.float32)
START = {"w": np.zeros(DIM, np.float32), "b": np.zeros(1, np.float32)}


def task(rank: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x, (x @ TRUE_W + 0.5 + 0.01 * rng.standard_normal(n)).astype(np.float32)


def gradients(values: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The mean squared error on (x, y) and its gradients."""
    err = x @ values["w"] + values["b"][0] - y
    return float(np.mean(err**2)), {"w": (2 * x.T @ err / len(y)).astype(np.float32),
                                    "b": np.array([2 * err.mean()], np.float32)}


def loss_of(values: dict[str, np.ndarray], n: int) -> float:
    return float(np.mean([gradients(values, *task(r))[0] for r in range(n)]))
