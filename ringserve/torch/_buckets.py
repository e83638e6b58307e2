"""Fusion buckets of DistributedOptimizer: how parameters are grouped, and each group's buffer."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ringserve.elastic import rider
from ringserve.errors import InvalidArgumentError

DEFAULT_FUSION_BYTES = 4 << 20
FUSION_BYTES_ENV = "RINGSERVE_FUSION_BYTES"


def fusion_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    """The fusion bucket size from RINGSERVE_FUSION_BYTES, or DEFAULT_FUSION_BYTES.

    Raises:
        InvalidArgumentError: the variable is not a non-negative integer.
    """
    raw = (os.environ if env is None else env).get(FUSION_BYTES_ENV, "")
    if not raw.strip():
        return DEFAULT_FUSION_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError(f"{FUSION_BYTES_ENV} ({raw!r}) must be a non-negative integer.")
    return value


class Bucket:
    """Parameters whose gradients are reduced together, and the state of their current reduction."""

    def __init__(self, params: list[torch.nn.Parameter], name: str, gap: int = 0) -> None:
        self.params = params
        self.name = name
        self.bounds: list[tuple[int, int]] = []
        offset = 0
        for p in params:
            self.bounds.append((offset, offset + p.numel()))
            offset += p.numel()
        self.numel = offset
        pinned = any(p.device.type == "cuda" for p in params) and torch.cuda.is_available()
        # Gradients, ``gap`` zeros, one presence flag per parameter, then the slots of a commit's
        # check that this allreduce may carry (ringserve.elastic.rider). The gap keeps the flags
        # out of every block of a block-scaled codec that holds gradients (see ringserve.codecs).
        self.flags_at = offset + gap
        self.rider_at = self.flags_at + len(params)
        self.heal_at = self.rider_at + rider.SLOTS
        self.buffer = torch.zeros(self.heal_at + rider.HEAL, dtype=params[0].dtype, device="cpu", pin_memory=pinned)
        self.ride: rider.Ride | None = None  # the commit's check that this reduction carries
        self.residual: Any = None  # error feedback: what this rank's encodings lost last time
        self.ready = 0
        self.future: Any = None
        self.ahead = False  # started before the backward pass: a healing step's zeros (DistributedOptimizer.heal_ahead)
        self.healing = False  # this reduction sends a healing rank's zeros (rider.py)
        self.finish: Callable[[Any], torch.Tensor] | None = None
        self.started_at = 0.0
        self.done_at = 0.0


def plan(params: list[torch.nn.Parameter], fusion_bytes: int,
          groups: int | list[list[torch.nn.Parameter]] | None) -> list[list[torch.nn.Parameter]]:
    """Splits parameters into buckets: explicit groups first, then the rest by size.

    The rest is taken in reverse order (backward's order); a bucket closes once it holds
    ``fusion_bytes`` or more, as DDP's buckets do, or when the next parameter has another dtype or
    device. So a bucket may pass ``fusion_bytes`` by its last parameter, and a bias next to a large
    weight rides with it rather than costing an allreduce of its own (every allreduce has a fixed
    cost on the loop; a bucket that closed before a large parameter left such small ones alone).
    """
    plans: list[list[torch.nn.Parameter]] = []
    rest = list(reversed(params))
    if isinstance(groups, list):
        taken: set[int] = set()
        for group in groups:
            members = [p for p in group if id(p) not in taken and any(p is q for q in params)]
            taken.update(id(p) for p in members)
            if members:
                plans.append(members)
        rest = [p for p in rest if id(p) not in taken]
    elif isinstance(groups, int) and groups > 0:
        n = min(groups, len(rest))
        cuts = [round(i * len(rest) / n) for i in range(n + 1)] if n else []
        for a, b in itertools.pairwise(cuts):
            plans.append(rest[a:b])
        rest = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in rest:
        nbytes = p.numel() * p.element_size()
        if current and (size >= fusion_bytes or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            plans.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        plans.append(current)
    # A group given by the caller may still mix dtypes or devices: split it.
    return [part for group in plans for part in _split_kinds(group)]


def _split_kinds(group: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in group:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.values())
