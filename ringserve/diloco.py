"""DiLoCo and Streaming DiLoCo over the ring: train alone, agree now and then.

DiLoCo (Douillard et al., 2023): every rank runs its own inner optimizer on its own data; every
``sync_every`` (H) inner steps, each rank's *pseudo-gradient*, the global parameters minus its
local ones, is averaged over the ring (with a codec and error feedback: int8 by default, a quarter
of float32's bytes), an outer SGD (Nesterov momentum, lr 0.7, as the paper) steps the global copy
with it, and every rank adopts the new global copy. One allreduce every H steps instead of every
step: H times less traffic, and the ranks compute undisturbed between syncs.

Streaming DiLoCo (Douillard et al., 2025), with torchft's knob names: with ``fragments`` F, the
parameters are split into F fragments, synced in turn, one every H / F steps (so each is synced
every H steps, and the peak of traffic is 1/F of the model). A fragment's allreduce starts at its
step and lands ``fragment_sync_delay`` (tau) steps later: meanwhile the ranks keep training, and
the allreduce runs in the background. When it lands, the outer step updates the fragment's global
copy and the local copy becomes ``alpha * local + (1 - alpha) * global`` (``fragment_update_alpha``;
0 adopts the global copy).

Consistency: the global copy is the same bytes on every rank after every outer step. Each rank
computes it from its own copy (the same bytes since the start) and the averaged pseudo-gradient
(the same bytes on every rank: see ringserve.codecs) with element-wise float32 operations, each
correctly rounded, in a fixed order, on every rank.

Elastic training: ``state_dict()`` holds the inner step count, the global copy and the outer
momentum; an elastic state that keeps it (``ringserve.torch.elastic.TorchState`` with the
DiLoCo optimizer) hands them to a joiner, and restores them after a failure, which costs at most
the steps since the last commit (commit after each outer step: at most one round). A sync whose
allreduce started in an older view (the world changed at a commit while it was in flight) is
dropped on every rank alike: the fragment's next sync carries its progress.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ringserve import api, codecs
from ringserve.errors import InvalidArgumentError, UsageError
from ringserve.worker.ops.process_sets import ProcessSet

_F32 = np.dtype(np.float32)


class Parameters(Protocol):
    """The local parameters DiLoCo reads and writes, each as a flat array of float values."""

    def sizes(self) -> list[int]:
        """The number of values of each parameter."""
        ...

    def read(self, index: int) -> np.ndarray:
        """Parameter ``index``'s values, flat (a view or a copy; not written to)."""
        ...

    def write(self, index: int, values: np.ndarray) -> None:
        """Sets parameter ``index`` to ``values`` (float32, flat)."""
        ...


class ArrayParameters:
    """numpy arrays of floating point values, updated in place by the caller's inner optimizer."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or not a.flags.writeable:
                raise InvalidArgumentError(
                    f"DiLoCo's parameters must be writable numpy arrays of floating point values; parameter {i} "
                    f"is {type(a).__name__} {getattr(a, 'dtype', '')}.")
        self.arrays = list(arrays)

    def sizes(self) -> list[int]:
        return [a.size for a in self.arrays]

    def read(self, index: int) -> np.ndarray:
        return self.arrays[index].reshape(-1)

    def write(self, index: int, values: np.ndarray) -> None:
        a = self.arrays[index]
        np.copyto(a, values.reshape(a.shape), casting="same_kind")


@dataclass(frozen=True)
class Schedule:
    """When each fragment's sync starts and lands (torchft's Streaming DiLoCo schedule).

    Fragment f starts at the inner steps ``(f + 1) H / F + k H`` (k >= 0, steps counted from 1)
    and lands ``fragment_sync_delay`` steps later.

    Raises:
        InvalidArgumentError: H < 1, F < 1, H not a multiple of F, or a delay not below H / F.
    """

    sync_every: int
    fragments: int = 1
    fragment_sync_delay: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise InvalidArgumentError(f"sync_every ({self.sync_every}) must be at least 1.")
        if self.fragments < 1:
            raise InvalidArgumentError(f"fragments ({self.fragments}) must be at least 1.")
        if self.sync_every % self.fragments:
            raise InvalidArgumentError(
                f"sync_every ({self.sync_every}) must be a multiple of fragments ({self.fragments}): one fragment "
                "is synced every sync_every / fragments steps.")
        if not 0 <= self.fragment_sync_delay < self.sync_every // self.fragments:
            raise InvalidArgumentError(
                f"fragment_sync_delay ({self.fragment_sync_delay}) must be at least 0 and below sync_every / fragments "
                f"({self.sync_every // self.fragments}): a fragment's sync lands before the next one starts.")

    def offset(self, fragment: int) -> int:
        return self.sync_every // self.fragments * (fragment + 1)

    def starts(self, step: int) -> list[int]:
        """The fragments whose sync starts after inner step ``step``."""
        return [f for f in range(self.fragments) if step >= self.offset(f)
                and (step - self.offset(f)) % self.sync_every == 0]

    def lands(self, step: int) -> list[int]:
        """The fragments whose sync lands after inner step ``step``."""
        return [f for f in range(self.fragments) if step >= self.offset(f) + self.fragment_sync_delay
                and (step - self.offset(f) - self.fragment_sync_delay) % self.sync_every == 0]


def split(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Consecutive parameters in ``fragments`` groups of about equal size (pure).

    Raises:
        InvalidArgumentError: fewer parameters than fragments.
    """
    if fragments > len(sizes):
        raise InvalidArgumentError(
            f"fragments ({fragments}) cannot exceed the number of parameters ({len(sizes)}): a parameter is never split.")
    cum = list(itertools.accumulate(sizes, initial=0))
    cuts = [0]
    for k in range(1, fragments):
        j, last = cuts[-1] + 1, len(sizes) - (fragments - k)  # at least one parameter each
        target = cum[-1] * k / fragments
        while j < last and cum[j] < target:
            j += 1
        if j - 1 > cuts[-1] and target - cum[j - 1] < cum[j] - target:
            j -= 1  # the cut before is nearer the even share
        cuts.append(j)
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def _checked_groups(groups: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """Explicit fragments, checked to hold every parameter index once.

    Raises:
        InvalidArgumentError: an empty fragment, or an index missing, repeated or out of range.
    """
    out = [list(g) for g in groups]
    flat = sorted(i for g in out for i in g)
    if not out or any(not g for g in out) or flat != list(range(count)):
        raise InvalidArgumentError(
            f"The fragments must hold each of the {count} parameters exactly once, and none may be empty; "
            f"they hold {len(flat)} entries in {len(out)} fragments.")
    return out


def outer_step(global_: np.ndarray, pseudo: np.ndarray, buf: np.ndarray | None, *, lr: float, momentum: float,
               nesterov: bool) -> None:
    """torch's SGD step on the global copy, in place, element-wise in float32 (pure): with momentum
    ``buf = momentum * buf + g``, then ``global -= lr * (g + momentum * buf if nesterov else buf)``."""
    if momentum:
        assert buf is not None
        buf *= np.float32(momentum)
        buf += pseudo
        direction = pseudo + np.float32(momentum) * buf if nesterov else buf
    else:
        direction = pseudo
    global_ -= np.float32(lr) * direction


def blend(local: np.ndarray, global_: np.ndarray, alpha: float) -> np.ndarray:
    """``alpha * local + (1 - alpha) * global`` (the global copy itself when alpha is 0)."""
    if alpha == 0:
        return global_
    return np.float32(alpha) * local.astype(_F32, copy=False) + np.float32(1 - alpha) * global_


@dataclass
class _Fragment:
    indices: list[int]
    bounds: list[tuple[int, int]]
    global_: np.ndarray
    momentum: np.ndarray | None = None
    residual: np.ndarray | None = None
    pending: tuple[concurrent.futures.Future[Any], int] | None = None  # the allreduce, and its view


class DiLoCoCore:
    """DiLoCo's rounds over any parameters (see the module's docstring); ``DiLoCo`` (numpy arrays)
    and ``ringserve.torch.DiLoCo`` build on it.

    Args:
        params: the local parameters.
        sync_every: H, inner steps between two syncs of each fragment.
        outer_lr: the outer SGD's learning rate.
        outer_momentum: the outer SGD's momentum.
        nesterov: the outer SGD's Nesterov momentum.
        compression: the codec of the pseudo-gradients' allreduce ("int8", "fp16", "bf16", None).
        error_feedback: with a lossy codec, carry what each rank's encodings lost to its next sync.
        fragments: F, fragments synced in turn (Streaming DiLoCo): a count (consecutive parameters
            of about equal size), or the groups themselves, lists of parameter indices that
            cover every parameter once (torchft's model fragments).
        fragment_sync_delay: tau, inner steps between a fragment's sync starting and landing; None:
            0 with one fragment, 1 with several (so that the allreduce overlaps an inner step).
        fragment_update_alpha: the local copy's share when a sync lands (0: adopt the global copy).
        should_quantize: torchft's switch: True is compression "int8", False no int8.
        name: the allreduces' names (``name``.f for fragment f).
        process_set: run over that set's ranks only.

    Raises:
        InvalidArgumentError: a knob out of range, named with its value.
    """

    def __init__(self, params: Parameters, *, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, compression: str | None = "int8", error_feedback: bool = True,
                 fragments: int | Sequence[Sequence[int]] = 1, fragment_sync_delay: int | None = None,
                 fragment_update_alpha: float = 0.0,
                 should_quantize: bool | None = None, name: str = "ringserve.diloco",
                 process_set: ProcessSet | None = None) -> None:
        if should_quantize is not None:
            if should_quantize and compression != "int8":
                raise InvalidArgumentError(f"should_quantize=True is int8 compression; compression={compression!r} conflicts.")
            if not should_quantize and compression == "int8":
                compression = None
        self.codec = None if compression in (None, "none") else compression
        codecs.codec(self.codec)  # raises InvalidArgumentError, naming it
        if outer_lr <= 0:
            raise InvalidArgumentError(f"outer_lr ({outer_lr}) must be greater than zero.")
        if not 0 <= outer_momentum < 1:
            raise InvalidArgumentError(f"outer_momentum ({outer_momentum}) must be at least 0 and below 1.")
        if nesterov and not outer_momentum:
            raise InvalidArgumentError("nesterov=True needs outer_momentum above 0 (as torch's SGD requires).")
        if not 0 <= fragment_update_alpha <= 1:
            raise InvalidArgumentError(f"fragment_update_alpha ({fragment_update_alpha}) must be between 0 and 1.")
        sizes = params.sizes()
        groups = split(sizes, fragments) if isinstance(fragments, int) else _checked_groups(fragments, len(sizes))
        delay = fragment_sync_delay if fragment_sync_delay is not None else (0 if len(groups) == 1 else 1)
        self.schedule = Schedule(sync_every, len(groups), delay)
        self.params = params
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), nesterov
        self.error_feedback = error_feedback and self.codec is not None
        self.alpha = float(fragment_update_alpha)
        self.name = name
        self.process_set = process_set
        self.inner_steps = 0
        self.outer_steps = 0
        self.captured = False
        self._fragments = []
        for group in groups:
            bounds, at = [], 0
            for i in group:
                bounds.append((at, at + sizes[i]))
                at += sizes[i]
            self._fragments.append(_Fragment(group, bounds, np.zeros(at, dtype=_F32)))

    # -- the rounds ------------------------------------------------------------------------

    def capture(self) -> None:
        """Takes the current parameters as the global copy (they must be the same on every rank)."""
        self._drop_pending()
        for frag in self._fragments:
            for i, (a, b) in zip(frag.indices, frag.bounds, strict=True):
                frag.global_[a:b] = self.params.read(i)
        self.captured = True

    def step(self) -> None:
        """Counts an inner step (call it after each), starting and landing the syncs it is due for.

        Raises:
            UsageError: no global copy was captured yet.
            RecoverableError: a sync's allreduce failed (the world changed, a peer died).
        """
        if not self.captured:
            raise UsageError("DiLoCo has no global copy yet: capture() the parameters, alike on every rank, first.")
        self.inner_steps += 1
        for f in self.schedule.starts(self.inner_steps):
            self._start(f)
        for f in self.schedule.lands(self.inner_steps):
            self._land(f)

    @property
    def in_flight(self) -> int:
        """Fragment syncs started and not landed yet."""
        return sum(1 for frag in self._fragments if frag.pending is not None)

    def _start(self, f: int) -> None:
        frag = self._fragments[f]
        self._drop(frag)
        pseudo = frag.global_.copy()
        for i, (a, b) in zip(frag.indices, frag.bounds, strict=True):
            pseudo[a:b] -= self.params.read(i)
        if self.error_feedback and frag.residual is None:
            frag.residual = np.zeros(pseudo.size, dtype=_F32)
        residual = frag.residual if self.error_feedback else None
        ctx = api.context()
        codec, name, ps = self.codec, f"{self.name}.{f}", self.process_set
        future = ctx.submit(lambda w: w.allreduce(pseudo, op="average", name=name, out=pseudo, compression=codec,
                                                  residual=residual, process_set=ps))
        frag.pending = (future, ctx.worker.running_view)

    def _land(self, f: int) -> None:
        frag = self._fragments[f]
        if frag.pending is None:
            return  # never started (a joiner, or a restore since): its next sync carries it
        future, view = frag.pending
        ctx = api.context()
        if ctx.worker.running_view != view:
            self._drop(frag)  # started in a world that has changed since: dropped on every rank alike
            return
        frag.pending = None
        pseudo = ctx.wait(future)
        if self.outer_momentum and frag.momentum is None:
            frag.momentum = np.zeros(frag.global_.size, dtype=_F32)
        outer_step(frag.global_, pseudo, frag.momentum, lr=self.outer_lr, momentum=self.outer_momentum,
                   nesterov=self.nesterov)
        for i, (a, b) in zip(frag.indices, frag.bounds, strict=True):
            self.params.write(i, blend(self.params.read(i), frag.global_[a:b], self.alpha))
        self.outer_steps += 1

    def _drop(self, frag: _Fragment) -> None:
        """Forgets a sync in flight, once its allreduce has ended (it writes into its buffer)."""
        if frag.pending is None:
            return
        future, _ = frag.pending
        frag.pending = None
        with contextlib.suppress(Exception):
            api.context().wait(future)
        if frag.residual is not None:
            frag.residual[:] = 0  # half of a dropped exchange

    def _drop_pending(self) -> None:
        for frag in self._fragments:
            if frag.pending is not None:
                self._drop(frag)

    def close(self) -> None:
        """Waits for the syncs in flight to end, and forgets them."""
        self._drop_pending()

    # -- what an elastic state keeps --------------------------------------------------------

    def global_values(self) -> list[np.ndarray]:
        """The global copy of each parameter, flat (views: do not write)."""
        out: list[np.ndarray] = [np.empty(0, _F32)] * len(self.params.sizes())
        for frag in self._fragments:
            for i, (a, b) in zip(frag.indices, frag.bounds, strict=True):
                out[i] = frag.global_[a:b]
        return out

    def state_dict(self) -> dict[str, Any]:
        """The inner step count, the global copy and the outer momentum, per fragment (copies)."""
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "captured": self.captured,
                "global": [frag.global_.copy() for frag in self._fragments],
                "momentum": [None if frag.momentum is None else frag.momentum.copy() for frag in self._fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a state_dict(): syncs in flight are dropped, error feedback starts afresh.

        Raises:
            InvalidArgumentError: the state is of other fragments or sizes.
        """
        globals_, momenta = list(state["global"]), list(state["momentum"])
        sizes = [frag.global_.size for frag in self._fragments]
        if [np.asarray(g).size for g in globals_] != sizes or len(momenta) != len(sizes):
            raise InvalidArgumentError(
                f"This DiLoCo state has fragments of {[np.asarray(g).size for g in globals_]} values; "
                f"this optimizer's have {sizes}.")
        self._drop_pending()
        for frag, g, m in zip(self._fragments, globals_, momenta, strict=True):
            frag.global_[:] = np.asarray(g, dtype=_F32).reshape(-1)
            frag.momentum = None if m is None else np.array(m, dtype=_F32).reshape(-1)
            frag.residual = None
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state.get("outer_steps", 0))
        self.captured = bool(state.get("captured", True))


class DiLoCo(DiLoCoCore):
    """DiLoCo over numpy arrays that the caller's inner optimizer updates in place.

    The global copy is taken at construction: the arrays must be the same on every rank then
    (broadcast them first). The knobs are DiLoCoCore's.

    Example:
        ```python
        rs.init()
        w = rs.broadcast(w0, root=0)
        opt = rs.DiLoCo([w], sync_every=50, compression="int8")
        for batch in data:
            w -= lr * grad(w, batch)     # the inner step, in place
            opt.step()                   # every 50 steps: average, outer step, adopt
        ```
    """

    def __init__(self, params: Sequence[np.ndarray], **knobs: Any) -> None:
        super().__init__(ArrayParameters(params), **knobs)
        self.capture()
