"""An optimizer that is another optimizer's face: DistributedOptimizer's base.

It is an ``Optimizer`` for ``isinstance`` (LR schedulers and GradScaler take it), yet it keeps no
optimizer state of its own: ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and every
attribute it lacks are the wrapped optimizer's. ``Optimizer.__init__`` is skipped on purpose, so
that nothing is held twice.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Wrapping"]


class Wrapping(torch.optim.Optimizer):
    """Delegates the optimizer's state and attributes to ``optimizer``.

    Args:
        optimizer: the wrapped ``torch.optim.Optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes this class and Optimizer lack: those of the wrapped optimizer.
        inner = self.__dict__.get("_optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
