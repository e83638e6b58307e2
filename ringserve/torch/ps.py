"""Training a torch model with the parameter server (ringserve.ps).

A drop-in for the step of a training loop:

```python
import ringserve.torch.ps as ps

opt = ps.ParameterServerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                  mode="ssp", staleness=2)
for x, y in data:
    opt.zero_grad()
    loss = loss_fn(model(x), y)   # a forward pre-hook puts the newest pulled values in the model
    loss.backward()
    opt.step()                    # pushes the gradients and starts the next pull, in the background
```

What ``step()`` does, by mode:

- **sync, async, ssp**: the shards run the optimizer (the wrapped one's kind and hyperparameters:
  ``torch.optim.SGD``, with or without momentum, or ``torch.optim.Adam``, per parameter group,
  with each group's current learning rate sent along, so LR schedulers work). The push starts as
  soon as backward has produced every gradient (``backward_passes_per_step`` times; a
  ``register_post_accumulate_grad_hook`` per parameter counts them, as DistributedOptimizer's do),
  or at ``step()`` for gradients that never came; it and the next pull run on a background loop
  while the caller goes on (the rest of its step, data loading, logging), and the model's forward
  waits for the pull. Code that changes gradients between backward and ``step()`` (clipping)
  passes ``push_in_backward=False``: the push then starts in ``step()``.
  Where the mode allows (async, and ssp with staleness >= 1), the forward does not even wait for
  the round in flight but for the one before it: push and pull overlap with a whole step of
  compute. In ssp that pull waits one step longer for the slowest worker, so the bound holds.
- **average** (federated averaging): the wrapped optimizer, any of torch's, steps locally; every
  ``average_every`` steps the change since the last pull is pushed, and the model takes the
  average of the workers' models (the shards' SGD with ``server_lr``, 1 by default).

The process joins ringserve's world first if it has not (``ringserve.init()``), and rank 0's
model is the job's initial one: every worker starts from the values it pulls.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.config import PSClientConfig
from ringserve.errors import InvalidArgumentError, UnsupportedError
from ringserve.ps.client import sync as ps_api
from ringserve.ps.client.aio import AsyncClient
from ringserve.ps.optim import Optimizer
from ringserve.ps.rules import check_mode
from ringserve.torch._wrapping import Wrapping

__all__ = ["ParameterServerOptimizer", "server_optimizer"]

Values = dict[str, np.ndarray]


def server_optimizer(optimizer: torch.optim.Optimizer, group: dict[str, Any], mode: str) -> Optimizer:
    """The shard optimizer that does what ``optimizer`` does to one of its parameter groups.

    Raises:
        UnsupportedError: an optimizer or an option the shards do not run (use mode='average').
    """
    lr = float(group["lr"])
    if group.get("maximize") or group.get("amsgrad"):
        raise UnsupportedError(f"The shards do not run {type(optimizer).__name__} with maximize or amsgrad.")
    if type(optimizer) is torch.optim.SGD:
        momentum = float(group.get("momentum", 0.0))
        if momentum:
            return Optimizer(kind="momentum", lr=lr, momentum=momentum, dampening=float(group.get("dampening", 0.0)),
                             nesterov=bool(group.get("nesterov", False)), weight_decay=float(group.get("weight_decay", 0.0)))
        return Optimizer(kind="sgd", lr=lr, weight_decay=float(group.get("weight_decay", 0.0)))
    if type(optimizer) is torch.optim.Adam:
        beta1, beta2 = group["betas"]
        return Optimizer(kind="adam", lr=lr, beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                         weight_decay=float(group.get("weight_decay", 0.0)))
    raise UnsupportedError(
        f"In {mode} mode the shards run the optimizer, and they run torch.optim.SGD (with or without momentum) "
        f"and torch.optim.Adam, not {type(optimizer).__name__}; mode='average' steps any optimizer on the workers."
    )


class ParameterServerOptimizer(Wrapping):
    """Wraps an optimizer so that ``step()`` trains ``model`` through the parameter server.

    A static wrapper, as DistributedOptimizer: ``param_groups``, ``state``, ``state_dict()`` and the
    other attributes are the wrapped optimizer's (so LR schedulers take it).

    Args:
        optimizer: torch.optim.SGD or Adam (any optimizer in average mode).
        model: the module whose forward waits for pulled values (a forward pre-hook).
        mode: sync, async, ssp or average.
        staleness: ssp's bound.
        average_every: average mode: local steps between two averages.
        server_lr: average mode: the shards' SGD learning rate on the mean change (1: plain averaging).
        sum: sync and average: apply the sum of a round's pushes, not their mean.
        max_lag: async and ssp: refuse pushes computed on values more than this many versions old.
        compression: the wire codec of pushes: none, fp16, bf16 or int8 (default RINGSERVE_PUSH_CODEC).
        overlap: let the forward use the values of the round before the one in flight, where the
            mode allows (default: async, and ssp with staleness >= 1); False: always the newest.
        push_in_backward: start the push once backward has produced every gradient (default);
            False: at step(), after whatever the caller does to the gradients (clipping).
        backward_passes_per_step: backward passes that accumulate into one push (gradient
            accumulation), as DistributedOptimizer's.
        config: the client's settings (default: from the worker's and RINGSERVE_*).
        context: the worker to train as (default: ringserve's default context, joined if need be).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, mode: str = "sync",
                 staleness: int = 0, average_every: int = 1, server_lr: float = 1.0, sum: bool = False,
                 max_lag: int = 0, compression: str | None = None, overlap: bool | None = None,
                 push_in_backward: bool = True, backward_passes_per_step: int = 1,
                 config: PSClientConfig | None = None, context: api.Context | None = None) -> None:
        check_mode(mode, staleness)
        if average_every < 1:
            raise InvalidArgumentError(f"average_every ({average_every}) must be at least 1.")
        if backward_passes_per_step < 1:
            raise InvalidArgumentError(f"backward_passes_per_step ({backward_passes_per_step}) must be at least 1.")
        self._optimizer = optimizer
        self._mode = mode
        self._average_every = average_every
        self._params: dict[str, torch.nn.Parameter] = {}
        groups: dict[str, int] = {}
        names = {id(p): name for name, p in model.named_parameters()}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise InvalidArgumentError(
                        f"A parameter of the optimizer's group {index} (shape {list(p.shape)}) is not one of the "
                        f"model's: pass the model whose parameters the optimizer steps."
                    )
                self._params[names[id(p)]] = p
                groups[names[id(p)]] = index
        if mode == "average":
            shard_optimizers = [Optimizer(kind="sgd", lr=server_lr)]
            groups = {}
        else:
            shard_optimizers = [server_optimizer(optimizer, g, mode) for g in optimizer.param_groups]
        if context is None:
            api.init()
            context = api.context()
        codec = {} if compression is None else {"push_codec": compression}
        tensors = {name: p.detach().cpu().numpy() for name, p in self._params.items()}
        self._client = ps_api.Client(tensors, mode=mode, optimizer=shard_optimizers, groups=groups,
                                     staleness=staleness, sum=sum, max_lag=max_lag,
                                     config=config or ps_api.client_config(context, **codec), context=context)
        self._load(self._client.values)
        allowed = mode == "async" or (mode == "ssp" and staleness >= 1)
        self._depth = 1 if allowed and overlap is not False else 0
        self._inflight: collections.deque[concurrent.futures.Future[Values | None]] = collections.deque()
        self._hook = model.register_forward_pre_hook(self._before_forward)
        self._passes_per_step = backward_passes_per_step
        self._passes: dict[str, int] = {}
        self._pushed = False  # this step's round has started (from the gradient hooks)
        self._grad_hooks: list[Any] = []
        if push_in_backward and mode != "average":
            for name, p in self._params.items():
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        self._local_steps = 0
        self._lock: asyncio.Lock | None = None
        self.rounds = 0
        self.outcomes: collections.Counter[str] = collections.Counter()

    # -- the wrapped optimizer's state and attributes are delegated by Wrapping -------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"ParameterServerOptimizer({self._optimizer!r}, mode={self._mode!r})"

    @property
    def client(self) -> ps_api.Client:
        """The numpy-level client underneath (its versions, counts and values)."""
        return self._client

    # -- the step --------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Pushes this step's gradients (average mode: steps locally, and every average_every
        steps pushes the change) and starts the next pull; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._mode == "average":
            self._optimizer.step()
            self._local_steps += 1
            if self._local_steps % self._average_every == 0:
                local = {name: p.detach().cpu().numpy().copy() for name, p in self._params.items()}
                self._start(lambda c: self._average(c, local))
            return loss
        if not self._pushed:
            self._push()
        self._pushed = False
        self._passes.clear()
        return loss

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._passes[name] = self._passes.get(name, 0) + 1
            complete = len(self._passes) == len(self._params) and min(self._passes.values()) >= self._passes_per_step
            if complete and not self._pushed:
                self._push()   # backward has produced every gradient: no need to wait for step()
                self._pushed = True

        return hook

    def _push(self) -> None:
        grads = {name: p.grad.detach().cpu().numpy().copy() for name, p in self._params.items() if p.grad is not None}
        lrs = [float(g["lr"]) for g in self._optimizer.param_groups]
        self._start(lambda c: self._round(c, grads, lrs))

    def _start(self, call: Callable[[AsyncClient], Any]) -> None:
        self._inflight.append(self._client.submit(call))
        self._client.admit()

    def _snapshot(self, client: AsyncClient) -> Values | None:
        # With a round still in flight when the forward reads these, the next pull would write
        # into them under the copy: the forward gets a copy of its own.
        return {k: v.copy() for k, v in client.values.items()} if self._depth else None

    def _turn(self) -> asyncio.Lock:
        # Rounds run one after another, in the order of the steps that started them: a client's
        # steps per shard are counted in order (two pushes at once could overtake each other,
        # and the later step would make the earlier one a duplicate). Made on the client's loop.
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _round(self, client: AsyncClient, grads: Values, lrs: list[float]) -> Values | None:
        async with self._turn():
            for outcome in await client.push(grads, lrs=lrs):
                self.outcomes[outcome] += 1
            await client.pull(lookahead=self._depth)
            return self._snapshot(client)

    async def _average(self, client: AsyncClient, local: Values) -> Values | None:
        async with self._turn():
            for outcome in await client.push_delta(local):
                self.outcomes[outcome] += 1
            await client.pull()
            return self._snapshot(client)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._wait(self._depth)

    def synchronize(self) -> None:
        """Waits for every round in flight and loads the newest values into the model."""
        self._wait(0)

    def _wait(self, keep: int) -> None:
        newest: Values | None = None
        waited = False
        timeout = self._client.config.round_timeout_s + self._client.config.shard_wait_s
        while len(self._inflight) > keep:
            future = self._inflight.popleft()
            try:
                newest = future.result(timeout) or newest
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise
            waited = True
            self.rounds += 1
        if waited:
            self._load(newest if newest is not None else self._client.values)

    def _load(self, values: Values) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(torch.from_numpy(values[name]).view_as(p))

    def close(self) -> None:
        """Waits for the rounds in flight, removes the hook and closes the client."""
        try:
            self.synchronize()
        finally:
            self._hook.remove()
            for handle in self._grad_hooks:
                handle.remove()
            self._client.close()
