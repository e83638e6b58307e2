"""ElasticSampler: a dataset split across the ranks that resumes mid-epoch after the world changes.

Each epoch has one order of the dataset's indices, the same on every rank (shuffled with
``seed + epoch``). The indices not yet processed are dealt round-robin to the ranks, padded by
wrapping around so that every rank gets as many. When the world changes, ``reset()`` deals what
is left of the epoch to the new ranks: no index is lost and, apart from the padding, none is seen
twice.

What was processed is recorded one of two ways, as in Horovod:

- ``record_batch(batch_idx, batch_size)``: every rank processed ``batch_size`` more of its share,
  so the first ``batch_size * num_replicas`` remaining positions of the order are done. All ranks
  record the same batches (they step together).
- ``record_indices(indices)``: this rank processed exactly these indices; a sync takes the union of
  every rank's, so ranks may record different ones.

Kept in a ``TorchState``, the sampler is committed, restored and synced with the rest of the state;
its ``state_dict()`` is what travels. Call ``set_epoch()`` at the end of each epoch (not its start),
so that a restart inside the epoch keeps what was processed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from ringserve.torch import basics


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Deals a dataset's indices to the ranks, and deals what remains again when the world changes.

    Args:
        dataset: anything with ``len()``; its size must not change.
        shuffle: shuffle the order each epoch (the same order on every rank).
        seed: the shuffle's seed; must be the same on every rank.

    Example:
        ```python
        sampler = hvd.elastic.ElasticSampler(dataset)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                for batch_idx, batch in enumerate(loader):
                    ...
                    state.sampler.record_batch(batch_idx, 32)
                    state.commit()
                state.sampler.set_epoch(state.epoch + 1)
        ```
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch``: forgets what was processed and takes that epoch's order."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that every rank processed one more batch of ``batch_size`` of its share."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Records that this rank processed these dataset indices."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a state from state_dict() and deals what remains to the current world."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        """Deals the indices this epoch has left to the ranks of the current world."""
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        self.remaining_indices = remaining(len(self.dataset), shuffle=self.shuffle, seed=self.seed + self.epoch,
                                           processed_num=self.processed_num, processed=self.processed_indices)
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        return iter(deal(self.remaining_indices, self.rank, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def remaining(length: int, *, shuffle: bool, seed: int, processed_num: int, processed: set[int]) -> list[int]:
    """The indices of an epoch's order (shuffled with ``seed``) after the first ``processed_num``
    positions, less those in ``processed``."""
    order = list(range(length))
    if shuffle:
        random.Random(seed).shuffle(order)
    return [i for i in order[processed_num:] if i not in processed]


def deal(indices: list[int], rank: int, num_replicas: int) -> list[int]:
    """Rank ``rank``'s share of ``indices``: every ``num_replicas``-th from position ``rank``,
    after padding by wrapping around so that every rank gets as many."""
    if not indices:
        return []
    total = math.ceil(len(indices) / num_replicas) * num_replicas
    padded = (indices * math.ceil(total / len(indices)))[:total]
    return padded[rank:total:num_replicas]
