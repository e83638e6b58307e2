"""DiLoCo for torch: an optimizer whose step() is an inner step, with an outer step every
``sync_every`` (see ringserve.diloco for the algorithm, the fragments and the consistency).

Where ``DistributedOptimizer`` averages every step's gradients, DiLoCo lets every rank train alone
with its inner optimizer and averages the ranks' progress (the pseudo-gradients) once every
``sync_every`` steps: the choice across clouds, where the link, not the GPU, sets the pace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ringserve.diloco import DiLoCoCore
from ringserve.errors import InvalidArgumentError
from ringserve.torch import basics
from ringserve.torch._wrapping import Wrapping

STATE_KEY = "ringserve.diloco"  # the outer state, inside the inner optimizer's state_dict


class TensorParameters:
    """torch parameters as DiLoCoCore reads and writes them: CPU float32 ones through numpy views
    (no copy), any other through a float32 host copy."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        for i, p in enumerate(params):
            if not p.is_floating_point():
                raise InvalidArgumentError(f"DiLoCo averages floating point parameters; parameter {i} is {p.dtype}.")
        self.params = params

    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    def read(self, index: int) -> np.ndarray:
        p = self.params[index].detach()
        if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
            return p.reshape(-1).numpy()
        return p.reshape(-1).to("cpu", torch.float32).numpy()

    def write(self, index: int, values: np.ndarray) -> None:
        p = self.params[index]
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(values)).view(p.shape))


class DiLoCo(Wrapping):
    """DiLoCo (and Streaming DiLoCo) around an inner optimizer.

    Each ``step()`` is an inner step. Every ``sync_every`` steps, the pseudo-gradients (the global
    parameters minus this rank's) are averaged over the ring with ``compression`` and error
    feedback, an outer SGD steps the global copy, and every rank adopts it: after each outer step
    the global copy is the same bytes on every rank. With ``fragments`` F, one 1/F of the
    parameters is synced every ``sync_every / F`` steps, its allreduce running in the background
    for ``fragment_sync_delay`` steps.

    The global copy is taken at the first step(), so broadcast the parameters before it
    (``hvd.broadcast_parameters``), or keep the optimizer in a ``TorchState`` (elastic training),
    which hands a joiner the global copy, the outer momentum and the step count. Buffers (a
    BatchNorm's statistics) stay each rank's own.

    It is an ``Optimizer`` for ``isinstance``; ``param_groups``, ``state`` and ``defaults`` are the
    inner optimizer's, so LR schedulers drive the inner learning rate.

    Args:
        model: the module (or an iterable of its parameters) being trained.
        inner: the inner optimizer over those parameters (AdamW in the paper).
        outer_lr: the outer SGD's learning rate (0.7, as the paper).
        outer_momentum: the outer SGD's momentum (0.9, as the paper).
        nesterov: the outer SGD's Nesterov momentum (on, as the paper).
        sync_every: H, inner steps between two syncs of each fragment.
        compression: "int8" (default), "fp16", "bf16", None, or hvd.Compression.int8 and the like.
        error_feedback: carry each rank's encoding loss to its next sync (with a lossy codec).
        fragments: a count F, or torchft's model fragments: modules whose parameters, together,
            are every parameter given once.
        fragment_sync_delay: Streaming DiLoCo's delay of a fragment's sync, in inner steps,
            named as torchft's (see ringserve.diloco.DiLoCoCore).
        fragment_update_alpha: alpha, as torchft names it: when a fragment's sync lands, its local
            copy becomes alpha * local + (1 - alpha) * global (0 adopts the global copy).
        should_quantize: torchft's switch: True is compression "int8", False no int8.
        process_set: average over that set's ranks only.
        name: the allreduces' names (two DiLoCo optimizers in one job need different ones).

    Raises:
        InvalidArgumentError: a knob out of range, or a compression that is not a wire codec.

    Example:
        ```python
        opt = hvd.DiLoCo(model, inner=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         outer_lr=0.7, outer_momentum=0.9, nesterov=True, sync_every=50,
                         compression="int8", fragments=1)
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        ```
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Parameter], inner: torch.optim.Optimizer, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, sync_every: int = 50,
                 compression: Any = "int8", error_feedback: bool = True,
                 fragments: int | Sequence[torch.nn.Module] = 1,
                 fragment_sync_delay: int | None = None, fragment_update_alpha: float = 0.0,
                 should_quantize: bool | None = None, process_set: object = None,
                 name: str = "ringserve.diloco") -> None:
        params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        if not params:
            raise InvalidArgumentError("DiLoCo was given no parameters.")
        super().__init__(inner)  # self._optimizer: the name broadcast_optimizer_state looks for
        groups: int | list[list[int]] = fragments if isinstance(fragments, int) else _groups(params, fragments)
        self._core = DiLoCoCore(TensorParameters(params), sync_every=sync_every, outer_lr=outer_lr,
                                outer_momentum=outer_momentum, nesterov=nesterov, compression=_codec(compression),
                                error_feedback=error_feedback, fragments=groups,
                                fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=fragment_update_alpha,
                                should_quantize=should_quantize, name=name,
                                process_set=basics.resolve_set(process_set))
        self._shapes = [p.shape for p in params]

    # -- delegation to the inner optimizer: Wrapping's -------------------------------------

    def __repr__(self) -> str:
        s = self._core.schedule
        return (f"DiLoCo(sync_every={s.sync_every}, fragments={s.fragments}, codec={self._core.codec}, "
                f"inner={self._optimizer!r})")

    # -- DiLoCo ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner step, then the syncs due after it (see ringserve.diloco).

        Raises:
            RecoverableError: a sync's allreduce failed (elastic training restores and retries).
        """
        if not self._core.captured:
            self._core.capture()
        result = self._optimizer.step() if closure is None else self._optimizer.step(closure)
        self._core.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def inner_steps(self) -> int:
        return self._core.inner_steps

    @property
    def outer_steps(self) -> int:
        """Fragment syncs landed so far (one per outer step with one fragment)."""
        return self._core.outer_steps

    @property
    def in_flight(self) -> int:
        """Fragment syncs started whose outer step is still to come."""
        return self._core.in_flight

    def global_parameters(self) -> list[torch.Tensor]:
        """The global copy of each parameter (new CPU float32 tensors), as of the last outer step."""
        return [torch.from_numpy(v.copy()).view(shape) for v, shape in zip(self._core.global_values(), self._shapes,
                                                                           strict=True)]

    def close(self) -> None:
        """Waits for the syncs in flight to end, and forgets them (before shutdown)."""
        self._core.close()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict, with DiLoCo's step count, global copy and momentum."""
        state = self._optimizer.state_dict()
        outer = self._core.state_dict()
        outer["global"] = [torch.from_numpy(g) for g in outer["global"]]
        outer["momentum"] = [None if m is None else torch.from_numpy(m) for m in outer["momentum"]]
        state[STATE_KEY] = outer
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a state_dict(); syncs in flight are dropped (see ringserve.diloco)."""
        state = dict(state_dict)
        outer = state.pop(STATE_KEY, None)
        self._optimizer.load_state_dict(state)
        if outer is not None:
            outer = dict(outer)
            outer["global"] = [torch.as_tensor(g, device="cpu").numpy() for g in outer["global"]]
            outer["momentum"] = [None if m is None else torch.as_tensor(m, device="cpu").numpy() for m in outer["momentum"]]
            self._core.load_state_dict(outer)


def _groups(params: list[torch.nn.Parameter], modules: Sequence[torch.nn.Module]) -> list[list[int]]:
    """The indices in ``params`` of each module's parameters (DiLoCoCore checks that they cover all)."""
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise InvalidArgumentError(f"DiLoCo's fragments are a count or modules, not {type(m).__name__}.")
        missing = [n for n, p in m.named_parameters() if id(p) not in index]
        if missing:
            raise InvalidArgumentError(f"The fragment's parameters {missing[:3]} are not among the model's.")
        groups.append([index[id(p)] for p in m.parameters()])
    return groups


def _codec(compression: Any) -> str | None:
    """A codec name from a name, None, or a ringserve.torch compressor with a wire codec."""
    if compression is None or isinstance(compression, str):
        return compression
    wire = getattr(compression, "wire", None)
    if wire is not None:
        return str(wire)
    if getattr(compression, "__name__", "") == "NoneCompressor":
        return None
    raise InvalidArgumentError(
        f"DiLoCo's compression is a wire codec (\"int8\", \"fp16\", \"bf16\", None or hvd.Compression.int8 and the "
        f"like), not {compression!r}.")
