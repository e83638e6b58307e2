"""Elastic training for torch, in Horovod's shape, reachable as ``hvd.elastic`` after the plain import:

```python
import ringserve.torch as hvd

sampler = hvd.elastic.ElasticSampler(dataset)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_world_change])

@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        ...
        state.commit()

train(state)
```

``run`` is ``ringserve.elastic.run``: on a recoverable error the state goes back to its last
commit, the wrapper waits for the next view, syncs the state from the rank holding the furthest
commit (rank 0, the longest-lived member, unless a survivor committed once more) and calls the
function again. Joiners are admitted at a commit and receive the state before their first step.
With ``RINGSERVE_CHECKPOINT_DIR`` set, rank 0 also writes committed states there (model,
optimizer and extras, pickled), and a world that lost every worker holding the last commit
resumes from the newest one; without it, that world fails with StateLostError.
Reset callbacks run after every change of the world.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import functools
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.elastic import ObjectState, State, rider, run
from ringserve.torch import functions
from ringserve.torch.optimizer import DistributedOptimizer
from ringserve.torch.sampler import ElasticSampler

log = logging.getLogger("ringserve.elastic")

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


class TorchState(ObjectState):
    """A model, an optimizer and any picklable extras, committed, restored and synced together.

    Args:
        model: the module whose parameters and buffers are kept.
        optimizer: its optimizer (a DistributedOptimizer or any torch optimizer).
        **kwargs: extra values (epoch, batch, ...) reachable as attributes. As in Horovod, an
            extra that is a module, an optimizer or an ElasticSampler is kept by its state_dict()
            (so several models or optimizers can be kept); any other value must be picklable.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._model_saved: dict[str, Any] = {}
        self._optimizer_saved: dict[str, Any] = {}
        self._stateful = {k: v for k, v in kwargs.items() if isinstance(v, _STATEFUL)}
        self._stateful_saved: dict[str, Any] = {}
        # A commit in place (WorkerConfig.commit_in_place): the live tensors it kept instead of
        # copies, each with its version then (the optimizer's count of steps then is its
        # ``committed_in_place_at``).
        self._held: list[tuple[torch.Tensor, int]] = []
        self._release: Callable[[], None] = lambda: None  # packs and sends a root's held tensors (_send_commit)
        self._packed: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self._packed.set_result(np.empty(0, dtype=np.uint8))
        for name, value in self._stateful.items():
            setattr(self, name, value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._stateful})

    def save(self) -> None:
        """Copies the model's and the optimizer's state into the tensors of the last save, where
        they still fit (see ``_copied``): a commit every step then allocates nothing, and copies
        only the bytes.

        Committing in place (``_in_place``), it copies none of the tensors that only the
        optimizer's step changes (the parameters it trains, its state): it keeps the live ones
        and their versions, and ``restore`` finds them unchanged or knows the commit is gone."""
        super().save()
        optimizer, in_place = self.optimizer, self._in_place()
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.committed_in_place_at = optimizer.applied_steps if in_place is not None else None
        kept: list[tuple[torch.Tensor, int]] = []
        if self.model is not None:
            trained = _trained_by(optimizer) if in_place else None
            self._model_saved = _copied(self._model_saved, self.model.state_dict(), trained, kept)
        if optimizer is not None:
            self._optimizer_saved = _copied(self._optimizer_saved, optimizer.state_dict(),
                                            (lambda _: True) if in_place else None, kept)
        self._held = kept
        self.dropped = False
        self._stateful_saved = {k: _copied(self._stateful_saved.get(k), getattr(self, k).state_dict())
                                for k in self._stateful}

    def _in_place(self) -> bool | None:
        """Whether this rank commits in place: None where the state does not (the setting is
        off, or the optimizer is not a DistributedOptimizer whose steps carry the commit's check,
        so that a failure surfaces before a step applies); False on rank 0 of a job that writes
        checkpoints, which pickles a commit only at the next one (it copies, as before); else True."""
        optimizer = self.optimizer
        if not (api.is_initialized() and api.context().config.commit_in_place):
            return None
        if type(optimizer) is not DistributedOptimizer or not optimizer.carries_rides:
            return None
        return not (api.context().config.checkpoint_dir and api.rank() == 0)

    def _holds_commit(self) -> bool:
        """Whether the tensors a commit in place kept are still that commit: no optimizer step
        since, and no in-place change to any of them (their versions)."""
        if not self._held:
            return True
        optimizer = self.optimizer  # a DistributedOptimizer: only its states commit in place (_in_place)
        assert isinstance(optimizer, DistributedOptimizer)
        if optimizer.applied_steps != optimizer.committed_in_place_at:
            return False
        return all(t._version == version for t, version in self._held)

    def rides(self) -> bool:
        """Whether a DistributedOptimizer of this state can carry a commit's check in its next
        step's gradient allreduce (ringserve.elastic.rider), which then needs none of its own."""
        kept = [self.optimizer, *self._stateful.values()]
        return any(isinstance(o, DistributedOptimizer) and o.carries_rides for o in kept)

    def heals(self) -> bool:
        """Whether a joiner of this state heals (ringserve.elastic.rider) rather than wait for its
        state: its optimizer sends zeros while the state is on its way, and no extra is kept by
        its state_dict() (the handoff needs none)."""
        kept = [self.optimizer, *self._stateful.values()]
        return any(isinstance(o, DistributedOptimizer) and o.heals_joiners for o in kept)

    def restore(self) -> None:
        super().restore()
        if isinstance(self.optimizer, DistributedOptimizer):
            self.optimizer.reset()
        if not self._holds_commit():
            # Committed in place, and the live tensors moved past the commit: this rank holds no
            # commit of the job now, and the sync gives it the state of one that does.
            log.warning("the elastic state commits in place and its tensors changed since commit %d "
                        "(an optimizer step, or an in-place change, after state.commit()); this rank "
                        "takes the state from a rank that holds the commit", self.commits)
            self.commits, self.dropped, self._held = 0, True, []
            if isinstance(self.optimizer, DistributedOptimizer):
                self.optimizer.committed_in_place_at = None  # it holds no commit for a step to overwrite
            self._restore_stateful()
            return
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            # A copy: the optimizer keeps the tensors it is given where no cast is needed, and
            # would train on the saved ones (a failure's path, so the copy costs nothing per step).
            self.optimizer.load_state_dict(_copied(None, self._optimizer_saved))
        self._restore_stateful()

    def take(self, root: int) -> None:
        """Every rank takes root's model, optimizer, extras, ``commits`` and ``lineage``.

        In two collectives, where Horovod's calls (``broadcast_parameters``, then
        ``broadcast_optimizer_state``, then the extras) take five: one object (the optimizer's
        skeleton with the extras and counters), then one fused broadcast of the model's and the
        optimizer's tensors. Only the root makes an optimizer state that does not exist yet: the
        others load the root's (a joiner's fresh optimizer took a step of zeros here for nothing).
        Each collective of a sync is time the members stand still while a joiner comes in.

        Where some ranks hold the root's commit already (``holding``: the members, when a joiner
        comes in), only the others need the state, and they get it point to point (``_hand_over``):
        the root hands the sends to its loop without waiting for them (``handoffs``), and the
        holders go on at once. A joiner that heals takes part in their first step with zeros
        before its state is in; one that does not receives the state first. A state
        with extras kept by their state_dict() (an ElasticSampler merges every rank's indices),
        or a world with checksums on (a damaged frame of a message, unlike one of a collective,
        is not seen by every rank), syncs in collectives of every rank.
        """
        if self.holding and not self._stateful and not api.context().config.checksum:
            self._hand_over(root)
            return
        is_root = api.rank() == root
        skeleton: Any = None
        sent: list[torch.Tensor] = []
        if is_root and self.optimizer is not None:
            skeleton, sent = functions.optimizer_payload(self.optimizer)
        payload = functions.broadcast_object((skeleton, self.commits, self.lineage, self._saved), root_rank=root,
                                             name="ringserve.elastic.torch_state")
        assert isinstance(payload, tuple)
        if not is_root:
            sent = self._receivers(payload[0])
        functions.broadcast_tensors_(self._model_tensors() + sent, root, "ringserve.elastic.torch_tensors")
        if not is_root:
            self._load(payload, sent)
        self._sync_stateful(root)
        self._taken(payload)

    def _hand_over(self, root: int) -> None:
        """``take`` where ranks ``holding`` hold the root's commit: the root sends it to each of
        the others as the sizes, the head (the pickled optimizer skeleton, counters and extras) and
        then the packed tensors (``_send_commit``), and each answers once it has them. The root
        makes no optimizer state that the holders lack. A receiver that heals goes on with the
        head: its first step sends zeros, from its first forward pass on
        (``DistributedOptimizer.heal_ahead``), and it loads the tensors once that step's average
        is in."""
        ctx, rank = api.context(), api.rank()
        if rank in self.holding:
            self.save()  # as every rank does after a sync: the live state, reset callbacks' changes included
        if rank == root:
            self._send_commit([r for r in range(api.size()) if r not in self.holding])
        if rank in self.holding:
            return

        async def receive_head(w: Any) -> tuple[np.ndarray, np.ndarray]:
            sizes = await w.recv(np.zeros(2, dtype=np.int64), root, HANDOFF_SIZES)
            return sizes, await w.recv(np.empty(int(sizes[0]), dtype=np.uint8), root, HANDOFF_HEAD)

        sizes, head = ctx.call(receive_head)
        payload = pickle.loads(head.tobytes())
        sent = self._receivers(payload[0])

        async def receive(w: Any) -> np.ndarray:
            body: np.ndarray = await w.recv(np.empty(int(sizes[1]), dtype=np.uint8), root, HANDOFF)
            await w.send(np.ones(1, dtype=np.int64), root, HANDOFF_ACK)
            return body

        arriving = ctx.submit(receive)
        if not self.heals():
            functions.unpack_into(ctx.wait(arriving), self._model_tensors() + sent)
            self._load(payload, sent)
            self._taken(payload)
            return
        # A healing step (ringserve.elastic.rider): the loop goes on at once with root's counters
        # and extras, and this rank's first allreduce sends zeros while the tensors are on their
        # way. Its commit stays the one it held until they are in, so that a failure before then
        # neither restores nor offers anything but what it holds.
        _, commits, lineage, saved = payload
        for name, value in copy.deepcopy(saved).items():  # live only: the commit it holds stays its own
            setattr(self, name, value)

        def arrived() -> None:
            functions.unpack_into(ctx.wait(arriving), self._model_tensors() + sent)
            self._load(payload, sent)
            self.commits, self.lineage = commits, lineage
            self.save()  # root's commit, which the step under way applies its average to
            self._saved = saved  # its extras as root saved them (the loop may have moved on since)

        rider.begin_heal(arrived)
        optimizer = self.optimizer
        if isinstance(optimizer, DistributedOptimizer) and self.model is not None:
            # The members' first step then waits for none of this rank's forward and backward. It
            # starts at the forward pass, not here: a loop that ends (or commits) first starts no
            # allreduce that the members would never join.
            def ahead(*_: Any) -> None:
                handle.remove()
                optimizer.heal_ahead()

            handle = self.model.register_forward_pre_hook(ahead)

    def _send_commit(self, receivers: list[int]) -> None:
        """The root's side of ``_hand_over``: its commit, just saved, to ``receivers``, from the
        saved copy. Each gets the sizes and the head at once; the tensors are packed once, on a
        thread (at once, or after this rank's step for receivers that heal), and sent from the
        loop: the root's next step waits for neither. Nothing writes the saved copy before the next
        commit, and that commit first waits for the packing (``_handed_off``)."""
        ctx = api.context()
        if receivers and self._held:
            # A commit in place is the live state, which this rank's next step changes while the
            # sends read it: these ones are copies (and a failure then restores from them).
            self._model_saved = _copied(None, self._model_saved)
            self._optimizer_saved = _copied(None, self._optimizer_saved)
            self._held = []
        skeleton: Any = None
        sent: list[torch.Tensor] = []
        if self.optimizer is not None:
            skeleton, sent = functions.state_payload(self._optimizer_saved)
        head = np.frombuffer(pickle.dumps((skeleton, self.commits, self.lineage, self._saved), protocol=5),
                             dtype=np.uint8)
        tensors = [t for _, t in sorted(self._model_saved.items()) if t is not None] + sent
        if not receivers:
            return
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()  # save()'s copies, which the packing thread reads
        sizes = np.array([head.size, functions.packed_size(tensors)], dtype=np.int64)
        # A healing receiver needs the tensors only once its first step's allreduce is back: they
        # are packed (on a thread) and sent after this rank's own step (rider.after_step), not
        # into its allreduce, which both ends' loops would then share with them. ``_handed_off``
        # lets them go at the latest, and waits for the packing before a commit writes the copy.
        packed: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self._packed = packed
        self._release = functools.partial(_pack, packed, tensors)
        if self.heals():
            rider.after_step(self._release)
        else:
            self._release()

        async def send(w: Any, to: int) -> None:
            await w.send(sizes, to, HANDOFF_SIZES)
            await w.send(head, to, HANDOFF_HEAD)
            # Shielded: one receiver's send cancelled must not cancel the packing the others wait for.
            await w.send(await asyncio.shield(asyncio.wrap_future(packed)), to, HANDOFF)
            # A send is done once its frames are on the link: the receiver's word that it has
            # them keeps a root that is done (its last commit, then shutdown) from closing the
            # link under them (chaos campaign, seed 13: a joiner admitted at the last commit).
            await w.recv(np.zeros(1, dtype=np.int64), to, HANDOFF_ACK)

        self.handoffs += [ctx.submit(functools.partial(send, to=r)) for r in receivers]

    def _handed_off(self, *, raising: bool = True, everything: bool = True) -> None:
        self._release()  # a root's tensors held back for its step go now
        with contextlib.suppress(Exception):  # a packing that failed fails the sends, raised below
            self._packed.result()  # the commit's save writes into the copy they are packed from
        super()._handed_off(raising=raising, everything=everything)

    def _model_tensors(self) -> list[torch.Tensor]:
        """The model's state_dict tensors, by name: what a sync sends first, and writes into in place."""
        if self.model is None:
            return []
        return [t for _, t in sorted(self.model.state_dict().items()) if t is not None]

    @staticmethod
    def _receivers(skeleton: Any) -> list[torch.Tensor]:
        return functions.receivers(skeleton) if skeleton is not None else []

    def _load(self, payload: tuple[Any, ...], received: list[torch.Tensor]) -> None:
        """Loads the root's optimizer state (its skeleton, first in ``payload``) from ``received``."""
        if payload[0] is not None:
            assert self.optimizer is not None
            functions.load_optimizer_payload(self.optimizer, payload[0], received)

    def _taken(self, payload: tuple[Any, ...]) -> None:
        """Takes the root's counters and extras (the rest of ``payload``), and saves: the sync's state is the commit."""
        _, self.commits, self.lineage, self._saved = payload
        ObjectState.restore(self)
        self.save()

    def snapshot(self) -> object:
        """The saved extras, model and optimizer state_dicts, and the extras kept by their state_dict()
        (tensors pickle as they are)."""
        return {"values": self._saved, "model": self._model_saved, "optimizer": self._optimizer_saved,
                "stateful": self._stateful_saved}

    def load_snapshot(self, snapshot: object) -> None:
        assert isinstance(snapshot, dict)
        self._held = []  # the snapshot's tensors are copies
        self._saved = snapshot["values"]
        self._model_saved = snapshot["model"]
        self._optimizer_saved = snapshot["optimizer"]
        self._stateful_saved = snapshot.get("stateful", {})

    # -- extras kept by their state_dict() (added to the methods above, one line each) -------------

    def _restore_stateful(self) -> None:
        for name in self._stateful:
            value = getattr(self, name)
            if isinstance(value, DistributedOptimizer):
                value.reset()
            value.load_state_dict(_copied(None, self._stateful_saved[name]))

    def _sync_stateful(self, root: int) -> None:
        """Takes root's extras; a sampler takes root's epoch and position, and every rank's indices."""
        for name in self._stateful:
            value = getattr(self, name)
            if isinstance(value, torch.nn.Module):
                functions.broadcast_parameters(value.state_dict(), root_rank=root)
            elif isinstance(value, torch.optim.Optimizer):
                functions.broadcast_optimizer_state(value, root_rank=root)
            else:
                own = value.state_dict()
                taken = functions.broadcast_object(own, root_rank=root, name=f"ringserve.elastic.sampler.{name}")
                assert isinstance(taken, dict)
                gathered = functions.allgather_object(own["processed_indices"],
                                                      name=f"ringserve.elastic.sampler_indices.{name}")
                merged = set(taken["processed_indices"]).union(*gathered)  # type: ignore[arg-type]
                value.load_state_dict({**taken, "processed_indices": sorted(merged)})


def _pack(packed: concurrent.futures.Future[np.ndarray], tensors: list[torch.Tensor]) -> None:
    """Packs a root's tensors into ``packed``, on a thread of its own, once (the training thread
    calls this; the sends on the loop wait for ``packed``)."""
    if packed.running() or packed.done() or not packed.set_running_or_notify_cancel():
        return  # already packing or packed

    def run() -> None:
        try:
            packed.set_result(functions.pack(tensors))
        except BaseException as exc:
            packed.set_exception(exc)

    threading.Thread(target=run, name="ringserve-handoff-pack", daemon=True).start()


def _trained_by(optimizer: Any) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor of a model's state_dict (a parameter's alias) is one ``optimizer`` trains."""
    trained = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
    return lambda t: t.data_ptr() in trained


def _copied(saved: Any, live: Any, hold: Callable[[torch.Tensor], bool] | None = None,
            held: list[tuple[torch.Tensor, int]] | None = None) -> Any:
    """A copy of the state_dict ``live`` (dicts, lists and tuples of tensors and plain values),
    written into ``saved``'s tensors (the last copy) wherever one has the same shape, dtype,
    layout and device and is not ``live``'s own tensor; elsewhere a new one (``clone``), and
    plain values deep-copied (``saved`` None: a new copy). A saved tensor that is the live one
    (an optimizer's ``load_state_dict`` keeps a tensor that needs no cast) is never written into:
    it is replaced, and the live one is left to train on. A tensor that ``hold`` accepts is not
    copied: it is kept as it is, and added to ``held`` with its version (a commit in place)."""
    if live is None or type(live) in _IMMUTABLE:
        return live  # the most of an optimizer's state_dict (param ids, hyperparameters): nothing to copy
    if isinstance(live, torch.Tensor):
        if hold is not None and held is not None and hold(live):
            held.append((live, live._version))
            return live
        if (isinstance(saved, torch.Tensor) and saved.shape == live.shape and saved.dtype == live.dtype
                and saved.layout == live.layout == torch.strided and saved.device == live.device
                and saved.data_ptr() != live.data_ptr()):
            return saved.copy_(live)
        return live.detach().clone()
    if type(live) in (dict, collections.OrderedDict):
        old = saved if isinstance(saved, dict) else {}
        out = type(live)((k, _copied(old.get(k), v, hold, held)) for k, v in live.items())
        if hasattr(live, "_metadata"):  # a module's state_dict: its version, which load_state_dict reads
            out._metadata = copy.deepcopy(live._metadata)
        return out
    if isinstance(live, (list, tuple)) and type(live) in (list, tuple):
        old_items = saved if isinstance(saved, (list, tuple)) and len(saved) == len(live) else [None] * len(live)
        return type(live)(_copied(o, v, hold, held) for o, v in zip(old_items, live, strict=True))
    return copy.deepcopy(live)


# The names of a sync's messages from the root to a rank that lacks its commit (TorchState._hand_over).
HANDOFF_SIZES = "ringserve.elastic.handoff.sizes"
HANDOFF_HEAD = "ringserve.elastic.handoff.head"
HANDOFF = "ringserve.elastic.handoff"
HANDOFF_ACK = "ringserve.elastic.handoff.ack"

_IMMUTABLE = (int, float, bool, str, bytes, complex)

# Values of TorchState's extras kept by their state_dict() rather than pickled.
_STATEFUL = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)
