"""Elastic training for torch, in Horovod's shape::

    import ringserve.torch as hvd
    import ringserve.torch.elastic as elastic

    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

``run`` is ``ringserve.elastic.run``: on a recoverable error the state goes back to its last
commit, the wrapper waits for the next view, syncs the state from the rank holding the furthest
commit (rank 0, the longest-lived member, unless a survivor committed once more) and calls the
function again. Joiners are admitted at a commit and receive the state before their first step.
With ``RINGSERVE_CHECKPOINT_DIR`` set, rank 0 also writes committed states there (model,
optimizer and extras, pickled), and a world that lost every worker holding the last commit
resumes from the newest one; without it, that world fails with StateLostError.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ringserve.elastic import ObjectState, State, run
from ringserve.torch import functions
from ringserve.torch.optimizer import DistributedOptimizer

__all__ = ["ObjectState", "State", "TorchState", "run"]


class TorchState(ObjectState):
    """A model, an optimizer and any picklable extras, committed, restored and synced together.

    Args:
        model: the module whose parameters and buffers are kept.
        optimizer: its optimizer (a DistributedOptimizer or any torch optimizer).
        **kwargs: extra values (epoch, batch, ...) reachable as attributes.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._model_saved: dict[str, Any] = {}
        self._optimizer_saved: dict[str, Any] = {}
        super().__init__(**kwargs)

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())

    def restore(self) -> None:
        super().restore()
        if isinstance(self.optimizer, DistributedOptimizer):
            self.optimizer.reset()
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)

    def take(self, root: int) -> None:
        if self.model is not None:
            functions.broadcast_parameters(self.model.state_dict(), root_rank=root)
        if self.optimizer is not None:
            functions.broadcast_optimizer_state(self.optimizer, root_rank=root)
        payload = functions.broadcast_object((self.commits, self.lineage, self._saved), root_rank=root)
        assert isinstance(payload, tuple)
        self.commits, self.lineage, self._saved = payload
        super().restore()
        self.save()

    def snapshot(self) -> object:
        """The saved extras, model state_dict and optimizer state_dict (tensors pickle as they are)."""
        return {"values": self._saved, "model": self._model_saved, "optimizer": self._optimizer_saved}

    def load_snapshot(self, snapshot: object) -> None:
        assert isinstance(snapshot, dict)
        self._saved = snapshot["values"]
        self._model_saved = snapshot["model"]
        self._optimizer_saved = snapshot["optimizer"]
