"""Fault-tolerant HSDP: FSDP2 shards a model inside each replica group, and ringserve replicates
the shards across the groups, so that a whole group can die and come back while the others train.

Each replica group is an ordinary ``torch.distributed`` job (a ``torchrun``, say) whose ranks
shard the model with FSDP2 over gloo or any backend. Its ranks also join one ringserve world,
which holds every rank of every group: the rank holding shard ``i`` in one group averages its
gradient shard with the ranks holding shard ``i`` in the others (a process set per shard), and a
group that dies is a view change of that world, found within ringserve's heartbeat bound.

```python
import torch
from torch.distributed.fsdp import fully_shard

from ringserve.torch import hsdp

group = hsdp.init()        # the group's process group (torchrun's env), then the ringserve world
model = build_model()
for block in model.blocks:
    fully_shard(block, mesh=group.mesh)
fully_shard(model, mesh=group.mesh)
optimizer = hsdp.DistributedOptimizer(torch.optim.AdamW(model.parameters()), group)
state = hsdp.HSDPState(model, optimizer, group, step=0)

@hsdp.run
def train(state):
    for state.step in range(state.step, steps):
        loss(model, batch(state.step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        state.commit()

train(state)
```

Launch each group as its own job with ``RINGSERVE_HSDP_GROUP`` naming it and
``RINGSERVE_COORDINATOR`` pointing at the one coordinator; restart a group whole when any of its
ranks dies. What holds it together:

- **A group comes in whole, and leaves whole.** ``init`` draws a gang name for this start of the
  group and the coordinator admits a gang's ranks only together (``WorkerConfig.gang``), so no
  view holds part of a group, and a restarted group never pairs with what is left of the one it
  replaces; a rank of a gang that leaves the view takes the rest of its gang with it.
- **A group fails together.** A step can fail on one rank of a group and pass on another (the
  shard-1 set lost a peer after the shard-0 set finished); a rank that went on alone would wait
  forever in FSDP's next all-gather. So every step's outcome, every commit and every sync is
  agreed inside the group (``ReplicaGroup.agreed``: one gloo allreduce of a code), and all of its
  ranks restore and wait for the next view together (``GroupMemberFailedError``).
- **A group that lost a rank ends.** The group's own backend fails when a rank of it dies; the
  others raise ``ReplicaGroupLostError`` and exit, and their launcher restarts the group, which
  then comes back like any group.
- **A restarted group takes each shard from its counterpart**: a sync broadcasts shard ``i``'s
  parameters, buffers and optimizer state within the shard-``i`` set, from the rank of one group
  whose ranks all hold the furthest commit (the one of the world's root, where it does).

A group syncs in the newest view any of its ranks knows of. Durable copies
(RINGSERVE_CHECKPOINT_DIR) would need every shard's: a state here refuses them.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ringserve import api
from ringserve.elastic import ObjectState
from ringserve.elastic import run as elastic_run
from ringserve.elastic.state import wait_for_view_after
from ringserve.errors import (
    CorruptFrameError,
    GroupMemberFailedError,
    HostsUpdatedInterrupt,
    InvalidArgumentError,
    RecoverableError,
    ReplicaGroupLostError,
    RingChangedError,
    RingserveError,
    StateLostError,
    UnsupportedError,
)
from ringserve.torch import basics, collectives, functions
from ringserve.torch.ops import Average
from ringserve.worker.ops.process_sets import ProcessSet

__all__ = ["DistributedOptimizer", "HSDPState", "ReplicaGroup", "init", "run"]

GROUP_ENV = "RINGSERVE_HSDP_GROUP"
# How long a rank of a group waits for the others in the group's own collectives (FSDP's, and the
# agreement below) before its backend gives up: they wait only on ringserve's calls, which have
# deadlines of their own, or on a rank that died, which a backend over TCP sees at once.
GROUP_TIMEOUT_S = 300.0

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# What a rank of a group did (ReplicaGroup.agreed): the group takes the worst. A damaged frame
# (checksums on) is retried in the same view by every rank of the group, as by the ranks that saw it.
_PASSED, _WORLD_CHANGES, _CORRUPT, _FAILED = 0, 1, 2, 3


@dataclass
class ReplicaGroup:
    """This process's replica group: its name, its ranks in torch.distributed, its mesh (for
    ``fully_shard``) and, in each view of the ringserve world, where every group's ranks stand.

    Attributes:
        name: the group's name (RINGSERVE_HSDP_GROUP).
        gang: the name of this start of the group, which the coordinator admits whole.
        rank, size: this process's rank in the group, and the group's size.
        mesh: the group's one-dimensional DeviceMesh, over its process group.
        process_group: the group's torch.distributed process group.
    """

    name: str
    gang: str
    rank: int
    size: int
    mesh: DeviceMesh
    process_group: dist.ProcessGroup
    # Set by each sync (HSDPState.take), for the view it ran in.
    shard_set: ProcessSet | None = None
    world_size: int = 0

    def agreed(self, action: Callable[[], T]) -> T:
        """Runs ``action`` (a step of ringserve's that can fail on some ranks of the world and pass
        on others), then makes every rank of this group do alike: if it failed on any of them, it
        fails on all (a RecoverableError, or the HostsUpdatedInterrupt the others got).

        Raises:
            GroupMemberFailedError: it passed here and failed on another rank of the group.
            ReplicaGroupLostError: the group's own backend failed (a rank of it died).
        """
        mine, result = _PASSED, None
        caught: RingserveError | None = None
        try:
            result = action()
        except HostsUpdatedInterrupt as exc:
            mine, caught = _WORLD_CHANGES, exc
        except CorruptFrameError as exc:
            mine, caught = _CORRUPT, exc
        except RecoverableError as exc:
            mine, caught = _FAILED, exc
        worst = self.agree_max(mine)
        if worst == mine:
            if caught is not None:
                raise caught
            return result  # type: ignore[return-value]
        if worst == _FAILED:
            raise GroupMemberFailedError(self.name, self.rank) from caught
        if worst == _CORRUPT:
            raise CorruptFrameError("ringserve.hsdp", f"a damaged frame on another rank of replica group {self.name!r}") \
                from caught
        # Another rank heard of a change of the world that this one did not: the commit's check is
        # one allreduce that either finished (with the same answer everywhere) or failed.
        raise RingChangedError(api.context().worker.running_view, api.context().worker.running_view,
                               f"rank {self.rank} of replica group {self.name!r} missed a change that another saw")

    def agree_max(self, mine: int) -> int:
        """The largest of the group's ranks' ``mine``, on every rank of the group (one allreduce).

        Raises:
            ReplicaGroupLostError: the group's own backend failed (a rank of it died).
        """
        word = torch.tensor([mine], dtype=torch.int64)
        try:
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=self.process_group)
        except RuntimeError as exc:  # DistBackendError: gloo's peer closed its socket
            raise ReplicaGroupLostError(self.name, self.rank, str(exc)) from exc
        return int(word.item())

    def layout(self, view_ranks: list[tuple[str, int, int]]) -> dict[str, dict[int, int]]:
        """Every group of a view (its gang) with the world rank of each of its ranks, from every
        rank's (gang, rank in its group, group size), in world rank order.

        Raises:
            InvalidArgumentError: groups of different sizes (every group shards the model alike).
            RingChangedError: a group that is not whole in this view: one of its ranks died (the
                view after it, without that group, is coming).
        """
        groups: dict[str, dict[int, int]] = {}
        for world_rank, (gang, rank, size) in enumerate(view_ranks):
            if size != self.size:
                raise InvalidArgumentError(
                    f"Replica groups of different sizes in one world: rank {world_rank}'s group ({gang}) has {size} "
                    f"ranks, this one's ({self.gang}) {self.size}; FSDP shards the model alike in every group.")
            groups.setdefault(gang, {})[rank] = world_rank
        for gang, ranks in groups.items():
            if sorted(ranks) != list(range(self.size)):
                view = api.context().worker.running_view
                raise RingChangedError(view, view, f"replica group {gang} has ranks {sorted(ranks)} of "
                                                   f"{self.size} in this view: one of them died")
        return groups


def init(*, timeout_s: float = GROUP_TIMEOUT_S, **overrides: Any) -> ReplicaGroup:
    """Starts this process's replica group and joins the ringserve world.

    The group's process group comes from torch.distributed's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: a torchrun of the group sets them), over gloo, unless the script
    made a default process group already; the group is named by RINGSERVE_HSDP_GROUP.

    Args:
        timeout_s: how long the group's collectives wait for one another (see GROUP_TIMEOUT_S).
        **overrides: WorkerConfig fields for ``ringserve.torch.init``.

    Raises:
        InvalidArgumentError: RINGSERVE_HSDP_GROUP is not set.
    """
    name = os.environ.get(GROUP_ENV, "")
    if not name:
        raise InvalidArgumentError(f"{GROUP_ENV} names this process's replica group; it is not set.")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    # A name for this start of the group, drawn by its rank 0: a restarted group is a new gang.
    nonce = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(nonce, src=0)
    gang = f"{name}/{int(nonce.item()):x}"
    basics.init(gang=gang, gang_size=size, **overrides)
    world = dist.group.WORLD
    assert world is not None
    return ReplicaGroup(name, gang, rank, size, mesh, world)


def run(func: F) -> F:
    """``ringserve.torch.elastic.run`` for a training function of a replica group (its first
    argument an HSDPState): as that one, and an error of the group's own backend (FSDP's
    collectives, when a rank of the group died) ends it as ReplicaGroupLostError, named.

    Raises:
        ReplicaGroupLostError: a rank of this group died; exit, and start the group again.
    """
    elastic = elastic_run(func)

    @functools.wraps(func)
    def wrapper(state: HSDPState, *args: Any, **kwargs: Any) -> Any:
        try:
            return elastic(state, *args, **kwargs)
        except RuntimeError as exc:
            if not _from_backend(exc):
                raise
            raise ReplicaGroupLostError(state.group.name, state.group.rank, str(exc).splitlines()[0]) from exc

    return wrapper  # type: ignore[return-value]


_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep


def _from_backend(exc: RuntimeError) -> bool:
    """Whether ``exc`` is an error of a torch.distributed backend (gloo raises a bare RuntimeError
    when a peer closes its socket): a DistBackendError, or a RuntimeError raised under a call of
    torch.distributed's with nothing but torch below it (a c10d call, or a functional collective's
    wait, as a DTensor's ``full_tensor()`` or ``redistribute()`` runs, whose error comes out of
    torch's op dispatch), and not one of ringserve's own."""
    if isinstance(exc, dist.DistBackendError):
        return True
    if isinstance(exc, RingserveError):
        return False
    files = []
    tb = exc.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    last = max((i for i, f in enumerate(files) if f.startswith(_TORCH_DISTRIBUTED)), default=None)
    return last is not None and all(f.startswith(_TORCH) for f in files[last:])


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer of a model sharded by FSDP2: ``step()`` averages each gradient shard
    with its counterparts in the other replica groups (one allreduce over the shard's process
    set), agrees on the outcome within the group, then steps.

    A parameter that no group's rank has a gradient for keeps ``grad=None``; one that some have,
    gets the average with zeros for the others (as ringserve.torch.DistributedOptimizer does).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: ReplicaGroup) -> None:
        # Not Optimizer.__init__: this wraps the optimizer's own state and param_groups.
        self.__dict__["_inner"] = optimizer
        self.__dict__["_group"] = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self._inner.param_groups

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._inner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Averages the gradient shards across the groups, agreed within the group.

        Raises:
            RecoverableError: the allreduce failed here or on another rank of the group.
        """
        params = [p for g in self._inner.param_groups for p in g["params"]]
        self._group.agreed(lambda: _average(params, self._group))

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self.synchronize()
        return self._inner.step(closure)


def _average(params: list[torch.Tensor], group: ReplicaGroup) -> None:
    """Averages every parameter's local gradient shard over the shard's set, in one allreduce of
    the shards with one presence flag per parameter after them."""
    if group.shard_set is None and group.world_size == 0:
        raise RingChangedError(0, 0, "no sync ran in this view yet (HSDPState and elastic.run set the shard sets)")
    grads = [_local(p.grad) if p.grad is not None else None for p in params]
    shards = [_local(p.detach()) for p in params]
    total = sum(s.numel() for s in shards)
    flat = torch.zeros(total + len(params), dtype=torch.float32)
    offset = 0
    for k, (g, s) in enumerate(zip(grads, shards, strict=True)):
        if g is not None:
            flat[offset: offset + s.numel()] = g.reshape(-1).to(torch.float32)
            flat[total + k] = 1.0
        offset += s.numel()
    collectives.allreduce_(flat, op=Average, name="ringserve.hsdp.grads", process_set=group.shard_set)
    offset = 0
    with torch.no_grad():
        for p, s, k in zip(params, shards, range(len(params)), strict=True):
            part = flat[offset: offset + s.numel()].view(s.shape)
            offset += s.numel()
            if flat[total + k] == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = _like(p, part.to(s.dtype).clone())
            else:
                _local(p.grad).copy_(part)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as ``p`` (a DTensor's placements, if it is one) over ``local``."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


@dataclass(frozen=True)
class _Kept:
    """An optimizer state tensor, as kept: its local shard, and how to rebuild it (a DTensor's
    shape, stride and placements over the group's mesh, or none for a plain tensor)."""

    local: torch.Tensor
    layout: tuple[Any, ...] | None


class HSDPState(ObjectState):
    """A sharded model and its optimizer, with picklable extras, committed, restored and synced
    by shard: each rank keeps its own shard, and a sync sends shard ``i`` within the shard-``i``
    set, from a group that holds the furthest commit.

    Args:
        model: the module sharded by FSDP2 over ``group.mesh``.
        optimizer: its optimizer (hsdp.DistributedOptimizer).
        group: this process's replica group (``init``).
        **kwargs: picklable extras (step, epoch, ...) reachable as attributes.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: ReplicaGroup,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self._tensors: list[torch.Tensor] = []  # the model's local tensors, as last saved
        self._optimizer: tuple[Any, dict[int, dict[str, Any]]] = ([], {})
        if api.context().config.checkpoint_dir:
            raise UnsupportedError("HSDPState keeps no durable copies (RINGSERVE_CHECKPOINT_DIR is set): each rank "
                                   "holds one shard, and a copy of rank 0's would not restore the others.")
        super().__init__(**kwargs)

    def _agreed(self, action: Callable[[], T]) -> T:
        """Every step of a commit and of a sync passes or fails on every rank of the group alike."""
        return self.group.agreed(action)

    def sync(self) -> None:
        """As State.sync, in the group's newest view: a rank that heard of a view later than
        another rank of its group would sync in the older one while the other waits in the newer
        one, and their agreements would pair steps of different syncs."""
        worker = api.context().worker
        mine = worker.view_id
        newest = self.group.agree_max(mine)
        if newest > mine:
            if worker.latest_view < newest:
                wait_for_view_after(newest - 1, self)
            worker.pin_view(newest)
        super().sync()

    # -- this rank's shard ------------------------------------------------------------------------

    def _model_locals(self) -> list[torch.Tensor]:
        return [_local(t) for _, t in sorted(self.model.state_dict().items()) if t is not None]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def save(self) -> None:
        super().save()
        live = self._model_locals()
        if [(t.shape, t.dtype) for t in live] == [(t.shape, t.dtype) for t in self._tensors]:
            for kept, now in zip(self._tensors, live, strict=True):
                kept.copy_(now)
        else:
            self._tensors = [t.detach().clone() for t in live]
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        state = {i: {k: _keep(v) for k, v in self.optimizer.state[p].items()}
                 for i, p in enumerate(self._params()) if p in self.optimizer.state}
        self._optimizer = (groups, state)

    def restore(self) -> None:
        super().restore()
        # A step that failed after backward (in its allreduce, or in the agreement after it) left
        # its gradients, which the step taken again would add to.
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, kept in zip(self._model_locals(), self._tensors, strict=True):
                live.copy_(kept)
        groups, state = self._optimizer
        for live_group, kept_group in zip(self.optimizer.param_groups, groups, strict=True):
            live_group.update(copy.deepcopy(kept_group))
        self.optimizer.state.clear()
        for i, p in enumerate(self._params()):
            if i in state:
                self.optimizer.state[p] = {k: _rebuilt(v, self.group.mesh) for k, v in state[i].items()}

    def snapshot(self) -> object:
        raise UnsupportedError("HSDPState keeps no durable copies (RINGSERVE_CHECKPOINT_DIR): each rank holds "
                               "one shard, and a copy of rank 0's would not restore the others.")

    def load_snapshot(self, snapshot: object) -> None:
        self.snapshot()

    def take(self, root: int) -> None:
        """Every rank takes the commit that ``root`` holds, by shard: the world's ranks learn where
        every group stands in this view, register one process set per shard, choose a group
        whose ranks all hold root's commit, and each set's rank of that group broadcasts its shard
        (parameters, buffers, the optimizer's state and hyperparameters, then the extras).

        Raises:
            RingChangedError: a group is not whole in this view.
            StateLostError: no group holds root's commit on all of its ranks.
        """
        group = self.group
        stands = functions.allgather_object((group.gang, group.rank, group.size, self.lineage, self.commits),
                                            name="ringserve.hsdp.layout")
        view_ranks = [(str(s[0]), int(s[1]), int(s[2])) for s in stands]  # type: ignore[index]
        groups = group.layout(view_ranks)
        wanted = stands[root][3:]  # type: ignore[index]
        whole = [g for g in sorted(groups) if all(stands[r][3:] == wanted for r in groups[g].values())]  # type: ignore[index]
        if not whole:
            view = api.context().worker.running_view
            raise StateLostError(step=int(wanted[1]), holders=[f"rank {root}"], view=view, best=int(wanted[1]),
                                 detail="no replica group holds it on every one of its ranks")
        source = view_ranks[root][0] if view_ranks[root][0] in whole else whole[0]
        sets = [sorted(g[i] for g in groups.values()) for i in range(group.size)]
        world = len(view_ranks)
        split = [s for s in sets if len(s) < world]  # one group of one rank: the world is the set
        bound = api.context().call(lambda w: w.add_process_sets(split)) if split else []
        mine = next((ps for ps in bound if api.rank() in ps.ranks), None)
        group.shard_set, group.world_size = mine, world
        self._take_shard(groups[source][group.rank], mine)

    def _take_shard(self, root: int, shard_set: ProcessSet | None) -> None:
        """Takes ``root``'s shard within ``shard_set``: one object (the optimizer's layout and
        hyperparameters, the counters and extras), then one fused broadcast of the tensors."""
        is_root = api.rank() == root
        if is_root:
            self.save()  # the live state, reset callbacks' changes included, as TorchState sends
        # Received into new tensors: a sync that fails half way leaves the last commit whole.
        tensors = self._tensors if is_root else [t.detach().clone() for t in self._model_locals()]
        groups, state = self._optimizer
        layout = {i: {k: _Slot(v.local.shape, v.local.dtype, v.layout) if isinstance(v, _Kept) else v
                      for k, v in s.items()} for i, s in state.items()}
        head = functions.broadcast_object((layout, groups, self.commits, self.lineage, self._saved), root_rank=root,
                                          name="ringserve.hsdp.state", process_set=shard_set)
        assert isinstance(head, tuple)
        layout, groups, commits, lineage, saved = head
        if not is_root:
            state = {i: {k: _Kept(torch.empty(v.shape, dtype=v.dtype), v.layout) if isinstance(v, _Slot) else v
                         for k, v in s.items()} for i, s in layout.items()}
        sent = [v.local for s in state.values() for v in s.values() if isinstance(v, _Kept)]
        functions.broadcast_tensors_(tensors + sent, root, "ringserve.hsdp.tensors", process_set=shard_set)
        if not is_root:
            self._tensors = tensors
            self._optimizer = (groups, state)
            self.commits, self.lineage, self._saved = commits, lineage, saved
            self.restore()


@dataclass(frozen=True)
class _Slot:
    """An optimizer state tensor's place in a sync's broadcast: its local shape and dtype, and its
    layout (``_Kept.layout``)."""

    shape: torch.Size
    dtype: torch.dtype
    layout: tuple[Any, ...] | None


def _keep(value: Any) -> Any:
    if isinstance(value, DTensor):
        return _Kept(value.to_local().detach().clone(), (value.shape, value.stride(), value.placements))
    if isinstance(value, torch.Tensor):
        return _Kept(value.detach().clone(), None)
    return copy.deepcopy(value)


def _rebuilt(value: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(value, _Kept):
        return copy.deepcopy(value)
    local = value.local.clone()
    if value.layout is None:
        return local
    shape, stride, placements = value.layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
