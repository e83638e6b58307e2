"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): gradients averaged as low-rank factors.

Each gradient matrix ``M`` (n x m: a tensor viewed as ``shape[0]`` rows, as torch's
``powerSGD_hook`` views it) is sent as two thin factors: ``P = M Q`` (n x r), averaged over the
ranks and orthogonalized, then ``Q = M^T P`` (m x r), averaged; every rank takes ``P Q^T`` as the
average. ``(n + m) r`` values travel instead of ``n m``. ``Q`` is kept from step to step (warm
start: one step of power iteration per training step), and what the approximation missed is added
to the next step's gradient (error feedback), so that nothing is lost over time.

Why it is not a wire codec (``ringserve.codecs``): a codec packs each chunk of a running sum on its
own, one element at a time, inside one ring allreduce. PowerSGD needs the whole matrix, and two
allreduces with a computation between them that needs the first one's result (orthogonalizing the
averaged ``P``, then ``M^T P``). So it is a stateful compressor that runs *around* the ring: a
``Round`` takes a bucket of gradients and gives the payload of the first allreduce; its result
gives the second payload; its result gives the average. Callers run the two allreduces (the numpy
API's ``PowerSGD.allreduce``, ``DistributedOptimizer``'s buckets): two round trips per bucket,
where torch's hook takes three (it reduces the uncompressed tensors alone first; here they travel
with ``P``).

Knobs, named as torch's ``PowerSGDState``'s: ``matrix_approximation_rank``,
``start_powerSGD_iter`` (plain allreduce before it), ``min_compression_rate`` (a tensor is
compressed only when ``(n + m) r min_compression_rate < n m``; vectors never are),
``use_error_feedback``, ``warm_start``, ``orthogonalization_epsilon`` and ``random_seed``.

Every rank ends with the same bytes. Only what comes out of an allreduce (the same bytes on every
rank, see ringserve.codecs) feeds the result, through arithmetic whose every operation is
correctly rounded: Gram-Schmidt with dot products summed exactly (``math.fsum`` of float64
products, which float32 values make exact) and ``P Q^T`` as a sum of ``r`` outer products in a
fixed order, never a BLAS call whose summation order depends on the CPU. So ranks on different
CPUs (across clouds) agree too. The local products ``M Q`` and ``M^T P`` use BLAS freely: they are
only inputs to an allreduce. The cost: on 2048 x 2048 at rank 4, about 30 ms for ``P Q^T``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ringserve.errors import InvalidArgumentError

_F32 = np.dtype(np.float32)
_BLOCK = 1 << 16  # values per row block of low_rank_product

# An allreduce (average) of an array under a name, on the caller's worker.
Reduce = Callable[[np.ndarray, str], Awaitable[np.ndarray]]

# Makes the initial Q of every compressed matrix of one bucket, in order: (seed, [(m, r), ...]).
InitQ = Callable[[int, Sequence[tuple[int, int]]], list[np.ndarray]]


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's rule: compress when ``(rows + cols) * rank * min_compression_rate < rows * cols``."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a tensor of ``shape`` is compressed as: ``shape[0]`` rows (one for a scalar)."""
    if not shape:
        return 1, 1
    rows = int(shape[0])
    return rows, (math.prod(int(s) for s in shape) // rows if rows else 0)


@dataclass(frozen=True)
class Matrix:
    """One compressed tensor: where it lies in the bucket, and where its P and Q lie."""

    start: int
    rows: int
    cols: int
    rank: int
    p_at: int
    q_at: int


@dataclass(frozen=True)
class Plan:
    """How a bucket of tensors of ``shapes`` (then ``exact`` values) is compressed.

    Compressed matrices are ordered as torch's hook orders them (grouped by shape, in order of
    first appearance), so that initial Qs drawn in that order are the hook's.
    """

    shapes: tuple[tuple[int, ...], ...]
    exact: int
    numel: int
    matrices: tuple[Matrix, ...]
    uncompressed: tuple[tuple[int, int], ...]  # (start, stop) of each tensor sent whole
    p_size: int
    q_size: int

    @property
    def plain_size(self) -> int:
        return sum(b - a for a, b in self.uncompressed)


def plan(shapes: Sequence[Sequence[int]], *, rank: int, min_compression_rate: float, exact: int = 0) -> Plan:
    """Which tensors of a bucket are compressed, and the layout of their factors (pure)."""
    starts, offset = [], 0
    for shape in shapes:
        starts.append(offset)
        offset += math.prod(int(s) for s in shape)
    by_shape: dict[tuple[int, int], list[int]] = {}
    uncompressed = []
    for i, shape in enumerate(shapes):
        rows, cols = matrix_shape(shape)
        r = min(rows, cols, rank)
        if r > 0 and should_compress(rows, cols, r, min_compression_rate):
            by_shape.setdefault((rows, cols), []).append(i)
        else:
            uncompressed.append((starts[i], starts[i] + rows * cols if shape else starts[i] + 1))
    matrices, p_at, q_at = [], 0, 0
    for (rows, cols), members in by_shape.items():
        r = min(rows, cols, rank)
        for i in members:
            matrices.append(Matrix(starts[i], rows, cols, r, p_at, q_at))
            p_at += rows * r
            q_at += cols * r
    if exact:
        uncompressed.append((offset, offset + exact))
    return Plan(tuple(tuple(int(s) for s in shape) for shape in shapes), exact, offset + exact, tuple(matrices),
                tuple(uncompressed), p_at, q_at)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """The dot product of two float32 vectors, correctly rounded: the same on every CPU."""
    return math.fsum((a.astype(np.float64) * b.astype(np.float64)).tolist())


def orthogonalize(p: np.ndarray, epsilon: float = 0.0) -> None:
    """Gram-Schmidt on the columns of ``p`` (float32, n x r), in place, as torch's hook does it.

    Deterministic on every CPU (see the module's docstring). A zero column stays zero (torch's
    hook would make it NaN without an epsilon, then log and zero it).
    """
    cols = p.shape[1]
    for i in range(cols):
        col = p[:, i]
        norm = np.float32(math.sqrt(_dot(col, col)))
        if epsilon:
            col /= norm + np.float32(epsilon)
        elif norm == 0:
            col[:] = 0
        else:
            col /= norm
        for j in range(i + 1, cols):
            rest = p[:, j]
            rest -= np.float32(_dot(col, rest)) * col


def low_rank_product(p: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """``out = p q^T`` (n x m) as a sum of outer products in a fixed order: every operation is one
    correctly rounded float32 multiply or add, so every CPU gets the same bytes. Row blocks of
    about 64K values keep each block's sum in cache (3x faster than whole passes here)."""
    rows, cols = out.shape
    step = max(1, _BLOCK // max(cols, 1))
    term = np.empty((min(step, rows), cols), dtype=out.dtype)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        block, t = out[a:b], term[: b - a]
        np.multiply(p[a:b, :1], q[:, 0], out=block)
        for k in range(1, p.shape[1]):
            np.multiply(p[a:b, k : k + 1], q[:, k], out=t)
            block += t


def default_init_q(seed: int, shapes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Standard normal Qs from numpy's generator seeded with ``seed``, in order."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]


@dataclass
class _KeyState:
    plan: Plan
    calls: int = 0
    error: np.ndarray | None = None
    q: np.ndarray | None = None  # the last averaged Qs (warm start)


@dataclass
class Round:
    """One reduction of one bucket: ``first`` to average, then ``second(result)`` to average (None:
    nothing compressed this time), then ``finish(result)`` gives the average.

    Attributes:
        first: the payload of the first allreduce (average).
        vanilla: the whole bucket travels uncompressed (before ``start_powerSGD_iter``).
    """

    state: _KeyState
    first: np.ndarray
    vanilla: bool
    feedback: bool
    warm_start: bool
    epsilon: float
    m: np.ndarray | None = None  # the local matrix values (gradient + error): kept for the error
    out: np.ndarray | None = None
    p: np.ndarray | None = None
    q: np.ndarray | None = None
    _stage: int = field(default=0)

    def second(self, reduced: np.ndarray) -> np.ndarray | None:
        """Takes the first allreduce's result; returns the second payload (the Qs), or None."""
        self._next(0)
        plan = self.state.plan
        out = self.out if self.out is not None else np.empty(plan.numel, dtype=_F32)
        self.out = out
        if self.vanilla:
            out[:] = reduced
            return None
        assert self.m is not None and self.q is not None
        at = 0
        for a, b in plan.uncompressed:
            out[a:b] = reduced[at : at + b - a]
            at += b - a
        p = np.array(reduced[at : at + plan.p_size], dtype=_F32)
        self.p = p
        for mat in plan.matrices:
            pm = p[mat.p_at : mat.p_at + mat.rows * mat.rank].reshape(mat.rows, mat.rank)
            orthogonalize(pm, self.epsilon)
            qm = self.q[mat.q_at : mat.q_at + mat.cols * mat.rank].reshape(mat.cols, mat.rank)
            np.matmul(_view(self.m, mat).T, pm, out=qm)
        return self.q if plan.matrices else None

    def finish(self, reduced: np.ndarray | None) -> np.ndarray:
        """Takes the second allreduce's result (None if there was none); returns the average."""
        self._next(1)
        state, plan, out = self.state, self.state.plan, self.out
        assert out is not None
        if not self.vanilla and plan.matrices:
            assert reduced is not None and self.p is not None
            q = np.array(reduced, dtype=_F32)
            for mat in plan.matrices:
                pm = self.p[mat.p_at : mat.p_at + mat.rows * mat.rank].reshape(mat.rows, mat.rank)
                qm = q[mat.q_at : mat.q_at + mat.cols * mat.rank].reshape(mat.cols, mat.rank)
                low_rank_product(pm, qm, _view(out, mat))
            state.q = q if self.warm_start else None
        if self.feedback and not self.vanilla:
            assert self.m is not None
            error = np.subtract(self.m, out, out=self.m)  # m is ours, and no longer needed
            if plan.exact:
                error[plan.numel - plan.exact :] = 0  # values reduced exactly (flags): no feedback
            state.error = error
        state.calls += 1
        return out

    def _next(self, stage: int) -> None:
        if self._stage != stage:
            raise InvalidArgumentError("A PowerSGD round's steps are second(), then finish(), once each.")
        self._stage += 1


def _view(flat: np.ndarray, mat: Matrix) -> np.ndarray:
    return flat[mat.start : mat.start + mat.rows * mat.cols].reshape(mat.rows, mat.cols)


class PowerSGD:
    """A PowerSGD compressor: its knobs and, per bucket name, its warm-start Qs and errors.

    Args:
        matrix_approximation_rank: r, the rank of the approximation (1 to 4 is usual).
        start_powerSGD_iter: calls of a bucket reduced uncompressed before PowerSGD starts.
        min_compression_rate: compress a matrix only if ``(n + m) r`` times this is below ``n m``.
        use_error_feedback: add what the approximation missed to the next call's input.
        warm_start: reuse the last averaged Q (else a fresh random one every call).
        orthogonalization_epsilon: added to each column's norm (guards all-zero columns).
        random_seed: seeds the initial Qs, alike on every rank.
        init_q: draws the initial Qs, (seed, shapes) -> arrays; numpy's normal generator by
            default (ringserve.torch passes torch's, as the DDP hook draws them).

    Raises:
        InvalidArgumentError: a knob out of range (named, with its value).

    Example:
        ```python
        ps = ringserve.PowerSGD(matrix_approximation_rank=4, start_powerSGD_iter=10)
        avg = ringserve.allreduce(grad_w, name="grad.w", compression=ps)   # every rank, every step
        ```
    """

    def __init__(self, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000, *,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0, init_q: InitQ | None = None) -> None:
        if matrix_approximation_rank < 1:
            raise InvalidArgumentError(
                f"matrix_approximation_rank ({matrix_approximation_rank}) must be at least 1.")
        if start_powerSGD_iter < 0:
            raise InvalidArgumentError(f"start_powerSGD_iter ({start_powerSGD_iter}) must not be negative.")
        if min_compression_rate <= 0:
            raise InvalidArgumentError(f"min_compression_rate ({min_compression_rate}) must be greater than zero.")
        if orthogonalization_epsilon < 0:
            raise InvalidArgumentError(
                f"orthogonalization_epsilon ({orthogonalization_epsilon}) must not be negative.")
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = random_seed
        self._init_q = init_q or default_init_q
        self._rng = np.random.RandomState(random_seed)  # one seed per fresh set of Qs, as torch's state.rng
        self._states: dict[str, _KeyState] = {}

    def __repr__(self) -> str:
        return (f"PowerSGD(matrix_approximation_rank={self.matrix_approximation_rank}, "
                f"start_powerSGD_iter={self.start_powerSGD_iter}, min_compression_rate={self.min_compression_rate:g}, "
                f"use_error_feedback={self.use_error_feedback}, warm_start={self.warm_start})")

    def plan(self, shapes: Sequence[Sequence[int]], exact: int = 0) -> Plan:
        return plan(shapes, rank=self.matrix_approximation_rank, min_compression_rate=self.min_compression_rate,
                    exact=exact)

    def begin(self, key: str, flat: np.ndarray, shapes: Sequence[Sequence[int]], *, exact: int = 0,
              iteration: int | None = None, out: np.ndarray | None = None) -> Round:
        """Starts one reduction of the bucket ``key``: ``flat`` holds tensors of ``shapes`` (float32),
        then ``exact`` values reduced exactly and without error feedback. ``iteration``: the step
        count compared with ``start_powerSGD_iter`` (by default, the calls of ``key`` so far);
        every rank must pass the same, since it decides what the first allreduce carries.
        ``out``: where finish() writes the average (float32, flat; ``flat`` itself will do: it is
        copied here), instead of a new array.

        Raises:
            InvalidArgumentError: ``key`` was reduced before with other shapes, ``flat`` is not
                float32, or its size does not match.
        """
        state = self._states.get(key)
        layout = self.plan(shapes, exact)
        if state is None:
            state = self._states[key] = _KeyState(layout)
        elif state.plan.shapes != layout.shapes or state.plan.exact != exact:
            raise InvalidArgumentError(f"The PowerSGD bucket {key!r} was reduced with shapes {list(state.plan.shapes)} "
                                f"and is now given {list(layout.shapes)}: use another name.")
        flat = np.asarray(flat)
        if flat.dtype != _F32 or flat.size != layout.numel:
            raise InvalidArgumentError(f"PowerSGD reduces float32 values: {key!r} needs {layout.numel} of them, "
                                       f"not {flat.size} of {flat.dtype}.")
        layout = state.plan
        vanilla = (state.calls if iteration is None else iteration) < self.start_powerSGD_iter
        feedback = self.use_error_feedback
        rnd = Round(state, np.array(flat, dtype=_F32).reshape(-1), vanilla, feedback, self.warm_start,
                    self.orthogonalization_epsilon)
        if out is not None:
            if out.dtype != _F32 or out.size != layout.numel:
                raise InvalidArgumentError(f"PowerSGD's out for {key!r} must hold {layout.numel} float32 values.")
            rnd.out = out.reshape(-1)
        if vanilla:
            return rnd
        m = rnd.first  # our own copy: gradient plus the error fed back
        if feedback and state.error is not None:
            m += state.error
        rnd.m = m
        if state.q is None:
            fresh = self._init_q(int(self._rng.randint(1_000_000_000)), [(x.cols, x.rank) for x in layout.matrices])
            q = np.concatenate([np.asarray(f, dtype=_F32).reshape(-1) for f in fresh]) if fresh else np.empty(0, _F32)
        else:
            q = state.q.copy()
        rnd.q = q
        p = np.empty(layout.p_size, dtype=_F32)
        for mat in layout.matrices:
            qm = q[mat.q_at : mat.q_at + mat.cols * mat.rank].reshape(mat.cols, mat.rank)
            orthogonalize(qm, self.orthogonalization_epsilon)  # local: only an input to the allreduce
            np.matmul(_view(m, mat), qm, out=p[mat.p_at : mat.p_at + mat.rows * mat.rank].reshape(mat.rows, mat.rank))
        plain = [m[a:b] for a, b in layout.uncompressed]
        rnd.first = np.concatenate([*plain, p]) if plain else p
        return rnd

    def error(self, key: str) -> np.ndarray | None:
        """The error bucket ``key`` feeds back into its next call (None before any)."""
        state = self._states.get(key)
        return None if state is None else state.error

    def reset(self, key: str | None = None) -> None:
        """Forgets the warm-start Qs, errors and call counts (of ``key``, or of every bucket)."""
        if key is None:
            self._states.clear()
        else:
            self._states.pop(key, None)


async def exchange(rnd: Round, name: str, allreduce: Reduce, *, offload: bool = True) -> np.ndarray | None:
    """Runs a round's two allreduces (``name``.p, then ``name``.q) and returns the second one's
    result, for ``rnd.finish``. ``offload``: the work between them (orthogonalization, ``M^T P``)
    runs in a thread, so that the event loop keeps moving other collectives' frames meanwhile."""
    first = await allreduce(rnd.first, f"{name}.p")
    second = await asyncio.to_thread(rnd.second, first) if offload else rnd.second(first)
    return None if second is None else await allreduce(second, f"{name}.q")
