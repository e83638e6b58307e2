"""DistributedOptimizer: averages gradients across ranks while backward is still running.

How it works:

- Gradients are packed into fusion buckets of about ``fusion_bytes`` (default 4 MiB, or
  RINGSERVE_FUSION_BYTES), in reverse parameter order, which is roughly the order backward produces
  them; a bucket closes once it holds ``fusion_bytes`` or more, as DDP's do. Each bucket is one
  named allreduce.
- A ``register_post_accumulate_grad_hook`` on every parameter counts its backward passes. When every
  parameter of a bucket has had ``backward_passes_per_step`` of them, the bucket is packed into a
  host buffer and its allreduce starts on the background loop, while backward computes the
  gradients of earlier layers: communication overlaps with compute.
- ``step()`` (or ``synchronize()``) starts the buckets that are still waiting, which holds
  parameters that got no gradient in this step, waits for all of them and writes the averages back
  into ``param.grad``.

Unused parameters: every bucket carries one flag per parameter, 1 when the rank had a gradient for
it, reduced together with the gradients. A parameter that no rank used keeps ``grad=None`` on every
rank; one that some rank used gets the reduced gradient (zeros stand in for the ranks without one)
on every rank. Every rank thus starts every bucket exactly once per step, and none hangs.

Sparse gradients (``nn.Embedding(..., sparse=True)``) are reduced as Horovod reduces them, unless
``sparse_as_dense``: their indices and values are gathered from every rank (sparse_allreduce_async)
and ``param.grad`` becomes the sparse sum or average, so that optimizers that need sparse gradients
(SparseAdam) take them. Their slot in the bucket stays zero with flag 0. A parameter with a sparse
gradient must get one on every rank in a step (as in Horovod), or the ranks' gathers do not meet.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.codecs import INT8_BLOCK, sum_dtype
from ringserve.elastic import rider
from ringserve.errors import InvalidArgumentError, UnsupportedError, UsageError
from ringserve.torch import _powersgd, _tensors, adasum, basics, ops, sparse
from ringserve.torch._buckets import Bucket, fusion_bytes_from_env, plan
from ringserve.torch._wrapping import Wrapping
from ringserve.torch.compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    PowerSGDCompressor,
    split,
    wire_codec,
)
from ringserve.torch.handles import Handle
from ringserve.worker.ops import adasum as adasum_math

log = logging.getLogger("ringserve.torch")


class DistributedOptimizer(Wrapping):
    """Wraps an optimizer so that ``step()`` applies gradients averaged over every rank.

    It is a static wrapper, not a run-time subclass: the wrapped optimizer keeps its state, and
    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and every other attribute are the
    wrapped optimizer's (see _wrapping.py). It is an ``Optimizer`` for ``isinstance``, so LR
    schedulers and GradScaler take it.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; checked to name every parameter once.
        compression: Compression.none (default), fp16, bf16 or int8: how gradients travel on the
            wire (sums are added in float32; see ringserve.torch.compression); or
            Compression.powersgd(rank=...): each float32 bucket averaged as PowerSGD's low-rank
            factors, with its own error feedback and warm start (op Average only).
        backward_passes_per_step: backward passes to accumulate locally before one allreduce.
        op: Average (default), Sum, or Adasum: on more than one rank, Adasum makes this an
            ``AdasumOptimizer`` (below; ringserve.torch.adasum), Horovod's delta optimizer.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size / factor after it.
        num_groups: Horovod's explicit fusion groups, as a count.
        groups: Horovod's explicit fusion groups, as lists of parameters.
        sparse_as_dense: reduce sparse gradients as dense ones (fused with the rest); by default
            they are gathered as indices and values and stay sparse.
        process_set: average over that registered set's members only (Horovod's). On a rank
            outside it, the optimizer reduces nothing: step() applies this rank's own gradients.
        fusion_bytes: bucket size in bytes; RINGSERVE_FUSION_BYTES or 4 MiB when None.
        error_feedback: with a lossy compression, add what this rank's encodings lost in one
            step to its gradients of the next (error feedback), so that nothing is lost over
            time and int8 training converges as uncompressed training does.
        check_finite: when a reduced gradient holds NaN or Inf (from any rank: NaN and Inf
            survive a sum), step() skips the wrapped optimizer's step on every rank alike, since
            every rank holds the same reduced gradients; ``skipped_steps`` counts such steps.

    Attributes:
        communication_intervals: (start, end) ``time.perf_counter()`` seconds of each bucket's
            allreduce in the last synchronize(), to measure how communication overlapped backward.
        skipped_steps: steps skipped for non-finite gradients (with ``check_finite``).

    Example:
        ```python
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        loss.backward()
        opt.step()
        ```
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, named_parameters: Any = None, compression: Any = None,
                backward_passes_per_step: int = 1, op: ops.ReduceOp = ops.Average, *args: Any,
                **kwargs: Any) -> DistributedOptimizer:
        # op=Adasum on more than one rank is Horovod's other optimizer, which reduces each step's
        # change to the parameters instead of the gradients (ringserve.torch.adasum).
        if cls is DistributedOptimizer and ops.resolve(op) is ops.Adasum and api.size() > 1:
            if basics.optimizer_set(kwargs.get("process_set", args[4] if len(args) > 4 else None)) is not None:
                raise UnsupportedError("Adasum does not support non-global process sets (as in Horovod).")
            return super().__new__(AdasumOptimizer)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: type[Compressor] | Compressor = Compression.none,
        backward_passes_per_step: int = 1,
        op: ops.ReduceOp = ops.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: int | list[list[torch.nn.Parameter]] | None = None,
        sparse_as_dense: bool = False,
        process_set: object = None,
        *,
        fusion_bytes: int | None = None,
        error_feedback: bool = False,
        check_finite: bool = False,
    ) -> None:
        # Optimizer.__init__ is skipped on purpose: all optimizer state lives in ``optimizer``.
        self._process_set = basics.optimizer_set(process_set)
        self._member = self._process_set is None or bool(self._process_set.included())
        reduce_op = ops.resolve(op)
        if reduce_op not in (ops.Average, ops.Sum, ops.Adasum):
            raise InvalidArgumentError(f"DistributedOptimizer reduces with Average, Sum or Adasum, not {reduce_op!r}.")
        if gradient_predivide_factor != 1.0 and reduce_op is not ops.Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average.")
        if gradient_predivide_factor <= 0:
            raise InvalidArgumentError(
                f"gradient_predivide_factor ({gradient_predivide_factor}) must be greater than zero."
            )
        if backward_passes_per_step < 1:
            raise InvalidArgumentError(
                f"backward_passes_per_step ({backward_passes_per_step}) must be at least 1."
            )
        fusion = fusion_bytes_from_env() if fusion_bytes is None else fusion_bytes
        if fusion < 0:
            raise InvalidArgumentError(f"fusion_bytes ({fusion}) must not be negative.")
        self._powersgd = compression if isinstance(compression, PowerSGDCompressor) else None
        self._powersgd_iter = 0
        if self._powersgd is not None:
            if reduce_op is not ops.Average or gradient_predivide_factor != 1.0 or error_feedback:
                raise InvalidArgumentError(
                    "Compression.powersgd averages (op=Average, no gradient_predivide_factor) and keeps its own "
                    "error feedback (its use_error_feedback knob): error_feedback=True does not apply.")
            compression = NoneCompressor
        self._compression, self._codec = split(compression)
        if error_feedback and self._codec is None:
            raise InvalidArgumentError(
                "error_feedback needs a wire compression (Compression.int8, fp16 or bf16)."
            )
        super().__init__(optimizer)
        self._error_feedback = error_feedback
        self._check_finite = check_finite
        self._finite = True
        self.skipped_steps = 0
        self._op = reduce_op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._sparse: dict[int, Handle[torch.Tensor]] = {}
        self.backward_passes_per_step = backward_passes_per_step
        self._fusion_bytes = fusion
        self._groups = groups if groups is not None else (num_groups or None)
        self._names = self._check_names(named_parameters)
        self._hooks: list[Any] = []
        self._buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, int]] = {}
        self._passes: dict[int, int] = {}
        self._should_synchronize = True
        self._synchronized = False
        self.communication_intervals: list[tuple[float, float]] = []
        # Steps the wrapped optimizer applied; and, while an elastic state commits in place
        # (TorchState, WorkerConfig.commit_in_place), the count at its last save: one more step
        # before the next save would overwrite the only copy of that commit (``step`` refuses it).
        self.applied_steps = 0
        self.committed_in_place_at: int | None = None
        self._rebuild()

    @property
    def carries_rides(self) -> bool:
        """Whether this optimizer's allreduces carry a commit's check (ringserve.elastic.rider):
        those over the whole world, through no compressor or one of ringserve's own, which keep
        a 0 and a 1 apart (a user's compressor need not)."""
        kind = self._compression if isinstance(self._compression, type) else type(self._compression)
        return self._member and self._process_set is None and kind in (NoneCompressor, FP16Compressor, BF16Compressor)

    @property
    def heals_joiners(self) -> bool:
        """Whether a joiner of a world training with this optimizer can heal (ringserve.elastic.rider):
        send zeros in its first step while its state is on its way. Those that carry rides, but
        PowerSGD, whose first steps differ with the step count that the state brings."""
        return self.carries_rides and self._powersgd is None

    # -- delegation (the rest is Wrapping's) -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = self._optimizer.state_dict()
        if self._powersgd is not None:
            state[_powersgd.STATE_KEY] = self._powersgd_iter
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _powersgd.STATE_KEY in state_dict:
            state_dict = dict(state_dict)
            self._powersgd_iter = int(state_dict.pop(_powersgd.STATE_KEY))
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group to the wrapped optimizer; every rank must add the same groups in order."""
        self._optimizer.add_param_group(param_group)
        if "_buckets" in self.__dict__:
            self._rebuild()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Each parameter's name, as Horovod's optimizer keeps them (code written for it reads this)."""
        return {p: self._names[id(p)] for p in self._params() if id(p) in self._names}

    # -- buckets and hooks -----------------------------------------------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        params = []
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _check_names(self, named: Iterable[tuple[str, torch.nn.Parameter]] | None) -> dict[int, str]:
        params = self._params()
        if named is None:
            return {id(p): f"param.{i}" for i, p in enumerate(params)}
        pairs = list(named)
        counts = collections.Counter(n for n, _ in pairs)
        duplicates = sorted(n for n, k in counts.items() if k > 1)
        if duplicates:
            raise InvalidArgumentError(f"Parameter names in named_parameters must be unique: {duplicates}.")
        by_id = {id(p): n for n, p in pairs}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise InvalidArgumentError(
                f"named_parameters does not name {len(missing)} of the optimizer's parameters "
                f"(positions {missing[:5]}); pass model.named_parameters() of the optimized model."
            )
        return by_id

    def _rebuild(self) -> None:
        self._check_idle("rebuild its buckets")
        self.remove_hooks()
        params = self._params()
        # Names tell this optimizer's buckets from another's. Shapes stay out of them on purpose: ranks
        # whose shapes differ then meet in the same collective and fail fast with a MismatchError.
        names = "|".join(self._names.get(id(p), "?") for p in params)
        prefix = "ringserve.grad." + hashlib.sha1(names.encode()).hexdigest()[:10]
        plans = plan(params, self._fusion_bytes, self._groups)
        gap = INT8_BLOCK if self._codec is not None else 0
        self._buckets = [Bucket(group, f"{prefix}.{i}", gap) for i, group in enumerate(plans)]
        self._slot = {id(p): (b, j) for b in self._buckets for j, p in enumerate(b.params)}
        if not self._member:
            return  # outside the process set: nothing to reduce, as Horovod's registers no hooks
        this = weakref.ref(self)
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(this)))

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks; the optimizer then no longer reduces gradients by itself."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, p: torch.Tensor) -> None:
        slot = self._slot.get(id(p))
        if slot is None:
            return
        self._synchronized = False
        passes = self._passes.get(id(p), 0) + 1
        self._passes[id(p)] = passes
        if passes > self.backward_passes_per_step:
            raise UsageError(
                f"The gradient of {self._names.get(id(p))} was computed {passes} times before step(), "
                f"more than backward_passes_per_step ({self.backward_passes_per_step}); call step() "
                "or synchronize() after each group of backward passes, or raise backward_passes_per_step."
            )
        if passes == self.backward_passes_per_step:
            bucket, _ = slot
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                if bucket.ahead:
                    self._ready_ahead(bucket)
                else:
                    self._start(bucket)

    def _scales(self) -> tuple[str, float, float]:
        """The reduction, the factor before it, and the factor after it times the world size (0:
        none): the size is the view's that runs the allreduce, read on the loop as it starts."""
        if self._op in (ops.Sum, ops.Adasum):  # Adasum here: a world of one, where it is the identity
            return "sum", 1.0, 0.0
        if self._predivide == 1.0:
            return "average", 1.0, 0.0
        return "sum", 1.0 / self._predivide, self._predivide

    def _start(self, bucket: Bucket, *, carry: bool = True) -> None:
        """Packs the bucket's gradients (zeros and flag 0 where missing) and starts its allreduce
        (carrying the current ride unless not ``carry``)."""
        core, prescale, postscale = self._scales()
        buf = bucket.buffer
        flags = []
        heals = self.heals_joiners and rider.healing()  # this rank's state is on its way: it sends zeros
        with torch.no_grad():
            for p, (a, b) in zip(bucket.params, bucket.bounds, strict=True):
                grad = p.grad
                if heals and grad is not None and grad.is_sparse and not self._sparse_as_dense:
                    grad = _no_indices(grad)
                elif heals:
                    grad = None
                if grad is None:
                    buf[a:b].zero_()
                    flags.append(0.0)
                    continue
                if grad.is_sparse and not self._sparse_as_dense:
                    buf[a:b].zero_()
                    flags.append(0.0)  # the dense reduction leaves it alone; the gather below reduces it
                    self._gather_sparse(bucket, p, grad)
                    continue
                flags.append(1.0)
                if _is_view_of(grad, buf, a):
                    continue  # already in the bucket: backward accumulated into it
                if grad.is_sparse:
                    grad = grad.to_dense()
                buf[a:b].copy_(grad.reshape(-1))
            # The gap is rewritten too: an in-place reduction of a non-finite block writes NaN there.
            buf[bucket.numel:bucket.flags_at].zero_()
            bucket.ride = rider.current() if self.carries_rides and carry else None
            bucket.healing = heals
            ride = bucket.ride.flags.tolist() if bucket.ride is not None else [0.0] * rider.SLOTS
            buf[bucket.flags_at:].copy_(torch.tensor(flags + ride + [float(heals)], dtype=buf.dtype, device=buf.device))
            if prescale != 1.0:
                buf.mul_(prescale)
        if self._powersgd is not None and _powersgd.applies(bucket):
            bucket.started_at = time.perf_counter()
            bucket.future, bucket.finish = _powersgd.start(bucket, self._powersgd, self._powersgd_iter,
                                                           self._process_set)
            return
        wire, cctx = self._compression.compress(buf)
        array, layout = _tensors.reducible(wire)
        name = bucket.name
        ps = self._process_set
        codec = wire_codec(self._codec, wire.dtype, array.dtype.kind)
        residual = self._residual(bucket, array) if codec is not None and self._error_feedback else None

        async def reduce(worker: Any) -> tuple[Any, float]:
            # On the loop, in the view the allreduce below starts in.
            size = worker.size if ps is None else len(ps.ranks)
            # In place: the array is the bucket's own buffer (or its compressed copy).
            result = await worker.allreduce(array, op=core, name=name, out=array, compression=codec,
                                            residual=residual, process_set=ps)
            return (result, size), time.perf_counter()

        averages = self._op not in (ops.Sum, ops.Adasum)

        def finish(done: tuple[Any, int]) -> torch.Tensor:
            result, size = done
            reduced = self._compression.decompress(_tensors.restore(result, layout), cctx)
            if postscale:
                reduced.mul_(postscale / size)
            healers = round(float(reduced[bucket.heal_at]) * (size if averages else 1))
            if averages and 0 < healers < size:
                # Ranks that heal sent zeros: the average is over the ranks that contributed.
                reduced[:bucket.flags_at].mul_(size / (size - healers))
            return reduced

        bucket.started_at = time.perf_counter()
        bucket.future = basics.submit(reduce)
        bucket.finish = finish

    def heal_ahead(self) -> None:
        """Starts this rank's healing step now, before its forward pass (rider.py): every bucket
        sends zeros, presence flags 0 and HEAL 1 whatever this rank's backward computes, so the
        members' first step need not wait for this rank's forward and backward (a new process's
        first ones are its slowest). The backward that follows starts nothing but the gathers
        of its sparse gradients (``_sparse_ahead``), and ``synchronize`` finishes the buckets as
        usual. Nothing is started where the step would not heal, or once a bucket is under way.
        """
        if not (self._member and self.heals_joiners and rider.healing()):
            return
        if any(b.future is not None for b in self._buckets) or self._passes:
            return
        for bucket in self._buckets:
            for p in bucket.params:
                # Whatever this rank held is not sent, and a gradient that is a view of a bucket
                # (a worker back after it was dropped) must not take backward's sums under reduction.
                p.grad = None
            self._start(bucket, carry=False)
            bucket.ahead = True
        self._synchronized = False

    def _ready_ahead(self, bucket: Bucket) -> None:
        """A bucket started ahead reached the point where the others start theirs (its backward
        made it ready, or synchronize came first): it takes the ride they take there, and its
        sparse gradients, which the others gather, are gathered with no index (their dense slots
        went as zeros with flag 0, as the others' do)."""
        bucket.ride = rider.current() if self.carries_rides else None
        for p in bucket.params:
            grad = p.grad
            if grad is not None and grad.is_sparse and not self._sparse_as_dense:
                self._gather_sparse(bucket, p, _no_indices(grad))

    def _gather_sparse(self, bucket: Bucket, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Starts the gather of a sparse gradient of ``p`` (Horovod's sparse allreduce), by name."""
        self._sparse[id(p)] = sparse.sparse_allreduce_async(
            grad, name=f"{bucket.name}.sparse.{self._names.get(id(p))}", op=self._op, process_set=self._process_set)

    @staticmethod
    def _residual(bucket: Bucket, array: np.ndarray) -> np.ndarray:
        if bucket.residual is None:
            bucket.residual = np.zeros(array.size, dtype=sum_dtype(array.dtype))
        residual: np.ndarray = bucket.residual
        return residual

    def _finish(self, bucket: Bucket) -> None:
        result, bucket.done_at = basics.wait(bucket.future)
        assert bucket.finish is not None
        out = bucket.finish(result)
        if bucket.residual is not None:
            bucket.residual[bucket.numel:] = 0  # the gap and the flags are no gradient: feed back nothing
        if self._check_finite:
            self._finite = self._finite and bool(torch.isfinite(out[: bucket.numel]).all())
        flags = out[bucket.flags_at:bucket.rider_at].tolist()
        ride, bucket.ride = bucket.ride, None  # an ahead bucket's: taken where the others' start (_ready_ahead)
        if ride is not None:
            ride.carried(out[bucket.rider_at:bucket.heal_at].tolist())
        with torch.no_grad():
            for p, (a, b), flag in zip(bucket.params, bucket.bounds, flags, strict=True):
                if flag == 0:  # no rank had a gradient: leave grad None everywhere
                    if bucket.healing:
                        p.grad = None  # a healing rank's own gradient was not sent: it is no one's
                    continue
                value = out[a:b].view(p.shape)
                if p.grad is not None and p.grad.is_sparse:  # sparse_as_dense: sparse again, as Horovod
                    p.grad = value.to(p.device).to_sparse()
                elif p.device.type == "cpu" and _is_view_of(value, bucket.buffer, a):
                    # The result is in the bucket: the gradient becomes a view of it, as DDP's
                    # gradient_as_bucket_view does, so the next step needs no copy out, and
                    # backward accumulates straight into the bucket unless grads are set to None.
                    if p.grad is None or not _is_view_of(p.grad, bucket.buffer, a):
                        p.grad = value
                elif p.grad is None:
                    p.grad = value.to(device=p.device, copy=True)
                else:
                    p.grad.copy_(value)
            for p in bucket.params:
                handle = self._sparse.pop(id(p), None)
                if handle is not None:
                    p.grad = handle.wait().to(p.device)

    def _check_idle(self, what: str, *, ahead: bool = False) -> None:
        """Raises UsageError while gradients are being reduced (``ahead``: a healing step's
        zeros started before the backward pass do not count)."""
        busy = any(b.future is not None and not (ahead and b.ahead) for b in self.__dict__.get("_buckets", []))
        if busy or self.__dict__.get("_passes"):
            raise UsageError(
                f"DistributedOptimizer cannot {what} between loss.backward() and step() or "
                "synchronize(): gradients are being reduced. Call step() or synchronize() first."
            )

    # -- Horovod's interface ---------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits until every gradient is reduced and written to ``param.grad``.

        Call it before inspecting or clipping gradients, then call step() inside
        skip_synchronize(). A second call with no backward pass in between does nothing.
        """
        if self._synchronized:
            return
        if not self._member:
            self._synchronized = True  # outside the process set: the gradients stay this rank's
            return
        self._finite = True
        for bucket in self._buckets:
            if bucket.future is None:
                self._start(bucket)
            elif bucket.ahead and bucket.ready < len(bucket.params):
                self._ready_ahead(bucket)  # where the others start the buckets that backward did not fill
        intervals = []
        try:
            for bucket in self._buckets:
                self._finish(bucket)
                intervals.append((bucket.started_at, bucket.done_at))
        except BaseException:
            self.reset()  # waits for the other buckets' reductions, which write into their buffers
            raise
        finally:
            for bucket in self._buckets:
                bucket.future, bucket.finish, bucket.ready, bucket.ahead = None, None, 0, False
            self._passes.clear()
        self.communication_intervals = intervals
        self._synchronized = True
        self._powersgd_iter += 1
        if self.heals_joiners:
            rider.heal()  # this rank's state, which the step's average now applies to (rider.py)
            rider.stepped()  # a root's sends of the state, held back from this step's way

    def reset(self) -> None:
        """Forgets a step cut short by a failure (elastic training calls it on restore).

        Waits for the reductions still in flight to end (they fail fast once their view is gone,
        and they write into the buckets), then clears what this step had recorded.
        """
        for bucket in self._buckets:
            if bucket.future is not None:
                with contextlib.suppress(Exception):
                    basics.wait(bucket.future)
            bucket.future, bucket.finish, bucket.ready, bucket.ride, bucket.ahead = None, None, 0, None, False
            bucket.residual = None  # half written by the step that failed
        for handle in self._sparse.values():
            with contextlib.suppress(Exception):
                handle.wait()
        self._sparse.clear()
        self._passes.clear()
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context, step() applies the gradients as they are, without synchronize()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Synchronizes (unless in skip_synchronize()) and runs the wrapped optimizer's step.

        Warns, as Horovod does, when synchronize() was called since the last backward pass and
        step() is not inside skip_synchronize(): that usually means the skip was forgotten.
        """
        held = self.committed_in_place_at
        if held is not None and self.applied_steps > held:
            raise UsageError(
                "optimizer.step() a second time since state.commit(): the elastic state commits in place "
                "(RINGSERVE_COMMIT_IN_PLACE=1), so its last commit is the live model and optimizer, and this "
                "step would overwrite it. Call state.commit() after every optimizer step, or turn in-place "
                "commits off to commit less often."
            )
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients were already reduced, so this step does "
                    "not reduce them again. Call step() inside optimizer.skip_synchronize() after "
                    "synchronize().", stacklevel=2)
            self.synchronize()
        if self._check_finite and not self._finite:
            self.skipped_steps += 1
            self._synchronized = False
            log.warning("step skipped: the averaged gradients hold NaN or Inf (on every rank alike); "
                        "%d steps skipped so far", self.skipped_steps)
            return None
        self.applied_steps += 1  # before the step: one that fails half way has changed the state too
        result = self._optimizer.step() if closure is None else self._optimizer.step(closure)
        self._synchronized = False
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, as the wrapped optimizer does.

        Raises:
            UsageError: called between backward() and step() or synchronize().
        """
        self._check_idle("zero the gradients", ahead=True)
        self._optimizer.zero_grad(set_to_none=set_to_none)



class AdasumOptimizer(DistributedOptimizer):
    """What ``DistributedOptimizer(..., op=Adasum)`` is on more than one rank: Horovod's delta
    optimizer. How it steps and combines the deltas is ``adasum.Deltas`` (ringserve.torch.adasum)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        # Horovod raises this at the first reduction; here at once, before any local step.
        adasum_math.check(np.dtype(np.float32), api.size())
        super().__init__(optimizer, *args, **kwargs)
        if self._error_feedback or self._check_finite:
            raise InvalidArgumentError("op=Adasum takes neither error_feedback nor check_finite.")
        if self._predivide != 1.0:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average, not Adasum.")
        self._deltas = adasum.Deltas(optimizer, adasum.casts_around(self._codec, self._compression))

    @property
    def carries_rides(self) -> bool:
        """False: an Adasum of deltas is no sum of flags (ringserve.elastic.rider)."""
        return False

    def _start(self, bucket: Bucket, *, carry: bool = True) -> None:
        self._deltas.start(bucket)  # carries no ride (carries_rides)

    def _finish(self, bucket: Bucket) -> None:
        self._deltas.finish(bucket)

    def reset(self) -> None:
        """Forgets a step cut short by a failure; parameters go back to where the step began."""
        super().reset()
        self._deltas.reset(self._params())

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Refused, as in Horovod: the Adasum optimizer's step is its synchronization."""
        raise UsageError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def synchronize(self) -> None:
        """Does nothing, as in Horovod's Adasum optimizer: step() combines and applies the deltas
        (a synchronize that applied them would let the next step() take its local steps again)."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Waits for every bucket's Adasum of deltas and applies it; the local steps ran as the
        gradients came in (or run now, for parameters whose gradients never came)."""
        loss = closure() if closure is not None else None
        self._synchronized = False
        DistributedOptimizer.synchronize(self)
        self._synchronized = False
        return loss


def _is_view_of(tensor: torch.Tensor, buffer: torch.Tensor, offset: int) -> bool:
    """Whether ``tensor`` is the dense slice of ``buffer`` that starts at element ``offset``."""
    return (not tensor.is_sparse and tensor.device == buffer.device and tensor.dtype == buffer.dtype
            and tensor.is_contiguous() and tensor.data_ptr() == buffer.data_ptr() + offset * buffer.element_size())


def _no_indices(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``grad``'s shape with no index: what a healing rank gives to the
    gather of the others' (the sum is theirs; divided, as Horovod's sparse average is, by the
    world's size)."""
    dims = grad.sparse_dim()
    return torch.sparse_coo_tensor(torch.empty((dims, 0), dtype=torch.long),
                                   torch.empty((0, *grad.shape[dims:]), dtype=grad.dtype), grad.shape, device=grad.device)


def _hook(optimizer: weakref.ref[DistributedOptimizer]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that holds its optimizer weakly, so a dropped optimizer stops reducing."""

    def on_grad(param: torch.Tensor) -> None:
        owner = optimizer()
        if owner is not None:
            owner._on_grad(param)

    return on_grad
