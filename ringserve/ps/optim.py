"""The shard's optimizers: SGD, SGD with momentum, and Adam, with torch.optim's update rules.

Pure numpy, one piece at a time; the state (momentum buffer, Adam's moments and step count)
lives beside the piece on its shard. The formulas are torch's, operation for operation, so that
a sync step on the shard equals ``torch.optim.SGD``'s (or Adam's) step on the mean gradient to
within float32 rounding:

- SGD: ``d = g + wd * p``; with momentum ``b = d`` at the first step, then
  ``b = momentum * b + (1 - dampening) * d``, and ``d = d + momentum * b`` (Nesterov) or
  ``d = b``; ``p = p - lr * d``.
- Adam: ``g = g + wd * p``; ``m = m + (g - m) * (1 - beta1)``; ``v = beta2 * v + (1 - beta2) g^2``;
  ``p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

A step returns a new values array instead of writing into the old one: a pull that is still
streaming the old array sends a consistent version (see ringserve/ps/shard/store.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ringserve.errors import InvalidArgumentError

KINDS = ("sgd", "momentum", "adam")


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """A server-side optimizer; ``kind`` is sgd, momentum or adam.

    Example:
        ```python
        Optimizer(kind="momentum", lr=0.1, momentum=0.9)
        Optimizer(kind="adam", lr=1e-3)
        ```
    """

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"The optimizer {self.kind!r} is not one the shards run; use one of {', '.join(KINDS)}.")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise InvalidArgumentError(f"The learning rate ({self.lr!r}) must be finite and at least 0.")
        if not self.weight_decay >= 0:
            raise InvalidArgumentError(f"The weight decay ({self.weight_decay!r}) must be at least 0.")
        if self.kind == "momentum" and not 0 < self.momentum < 1:
            raise InvalidArgumentError(f"The momentum ({self.momentum!r}) must be in (0, 1) for the momentum optimizer.")
        if self.kind == "sgd" and self.momentum:
            raise InvalidArgumentError(f"The sgd optimizer takes no momentum ({self.momentum!r}); use kind='momentum'.")
        if self.nesterov and (self.kind != "momentum" or self.dampening):
            raise InvalidArgumentError("Nesterov momentum needs the momentum optimizer and no dampening.")
        if self.kind == "adam":
            for name in ("beta1", "beta2"):
                if not 0 <= getattr(self, name) < 1:
                    raise InvalidArgumentError(f"Adam's {name} ({getattr(self, name)!r}) must be in [0, 1).")
            if not self.eps > 0:
                raise InvalidArgumentError(f"Adam's eps ({self.eps!r}) must be greater than 0.")


@dataclass
class State:
    """One piece's optimizer state: Adam's step count and moments, or the momentum buffer (``m``)."""

    step: int = 0
    m: np.ndarray | None = None
    v: np.ndarray | None = None

    def to_arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps (copies: the arrays change in place at the next step)."""
        out = {"step": np.asarray(self.step, dtype=np.int64)}
        if self.m is not None:
            out["m"] = self.m.copy()
        if self.v is not None:
            out["v"] = self.v.copy()
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> State:
        return cls(step=int(arrays["step"]), m=arrays.get("m"), v=arrays.get("v"))


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float16 values step in float32, as torch's autocast keeps master weights; others in their own."""
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def step(opt: Optimizer, values: np.ndarray, grad: np.ndarray, state: State, lr: float | None = None) -> np.ndarray:
    """One optimizer step of a piece: returns the new values (a new array) and updates ``state``.

    ``lr`` overrides the optimizer's learning rate (a schedule on the worker).
    """
    rate = opt.lr if lr is None else lr
    work = _work_dtype(values.dtype)
    p = values.astype(work, copy=False)
    g = grad.astype(work, copy=False)
    if opt.weight_decay:
        g = g + work.type(opt.weight_decay) * p
    if opt.kind == "adam":
        return _adam(opt, p, g, state, rate).astype(values.dtype, copy=False)
    if opt.kind == "momentum":
        if state.m is None:
            state.m = np.array(g, dtype=work, copy=True)
        else:
            state.m *= work.type(opt.momentum)
            state.m += work.type(1 - opt.dampening) * g
        g = g + work.type(opt.momentum) * state.m if opt.nesterov else state.m
    state.step += 1
    new: np.ndarray = (p - work.type(rate) * g).astype(values.dtype, copy=False)
    return new


def _adam(opt: Optimizer, p: np.ndarray, g: np.ndarray, state: State, lr: float) -> np.ndarray:
    work = p.dtype.type
    if state.m is None or state.v is None:
        state.m = np.zeros_like(p)
        state.v = np.zeros_like(p)
    state.step += 1
    state.m += (g - state.m) * work(1 - opt.beta1)
    state.v *= work(opt.beta2)
    state.v += work(1 - opt.beta2) * g * g
    correction1 = 1 - opt.beta1**state.step
    correction2_sqrt = math.sqrt(1 - opt.beta2**state.step)
    denom = np.sqrt(state.v) / work(correction2_sqrt) + work(opt.eps)
    new: np.ndarray = p - work(lr / correction1) * (state.m / denom)
    return new
