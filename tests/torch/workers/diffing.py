"""What the ranks of the differential world share: their inputs, the comparison, the record.

``value(rank, shape, dtype)`` is every input, a known function of the rank, so a rank can compute
what another rank passed. ``differs(a, b)`` compares two results: exactly for integer and bool
tensors (and anything that is not a tensor), within ``TOLERANCE`` for floating point ones, since
ringserve's ring adds in another order than gloo does (and adds bfloat16 in float32, rounding
once). ``Recorder.differ`` runs one call on both kinds of group and records what it found.

``RINGSERVE_TEST_DEVICE=cuda`` runs ringserve's side of every call on the GPU: its tensors are made
there (torch's default device, within the call), gloo's twin runs on the CPU, and the results are
compared on the host, after a check that every tensor ringserve's call returned is still on the GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# (rtol, atol) per floating point dtype: a few units in the last place of each dtype, for values
# of the size these inputs reach (tens, or a few thousands for products).
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12), torch.complex128: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5), torch.complex64: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 5e-2),
}


def value(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: mixed signs and fractions for floats, small integers otherwise
    (so that products of three stay in range), a pattern of both values for bool."""
    base = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return (base + rank + salt) % 3 == 0
    if dtype.is_floating_point or dtype.is_complex:
        x = base * 0.37 + rank * 1.3 + salt * 0.11 - 1.5
        return (torch.complex(x, 0.5 * x - rank) if dtype.is_complex else x).to(dtype)
    if dtype == torch.uint8:
        return ((base + 3 * rank + salt) % 7).to(dtype)
    return ((base + 3 * rank + salt) % 9 - 4).to(dtype)


# Where ringserve's side of each call makes its tensors (gloo's side: the CPU).
DEVICE = torch.device(os.environ.get("RINGSERVE_TEST_DEVICE", "cpu"))


def on_host(x: Any, where: str = "result") -> tuple[Any, str]:
    """``x`` with every tensor in it moved to the CPU, and where one was not on ``DEVICE`` ("" if none)."""
    if isinstance(x, torch.Tensor):
        wrong = "" if x.device.type == DEVICE.type else f"{where} is on {x.device}, not {DEVICE}"
        return x.cpu(), wrong
    if isinstance(x, list | tuple):
        pairs = [on_host(y, f"{where}[{i}]") for i, y in enumerate(x)]
        return type(x)(y for y, _ in pairs), next((w for _, w in pairs if w), "")
    return x, ""


class LeftDevice(Exception):
    """A tensor that ringserve's call returned is not on ``DEVICE``: a failure, never a refusal."""


def on_device(call: Callable[[Any], Any], group: Any) -> Any:
    """``call(group)`` with its tensors made on ``DEVICE``; the result on the host.

    Raises:
        LeftDevice: a tensor of the result is not on ``DEVICE``.
    """
    with DEVICE:
        got, wrong = on_host(call(group))
    if wrong:
        raise LeftDevice(wrong)
    return got


def _short(x: Any) -> str:
    return repr(x)[:300]


def differs(a: Any, b: Any, where: str = "result") -> str:
    """How ``a`` differs from ``b`` ("" if it does not, within TOLERANCE for floating point)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: {len(a)} items, not {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := differs(x, y, f"{where}[{i}]"))), "")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
            return f"{where}: {a.dtype} {tuple(a.shape)} {a.layout}, not {b.dtype} {tuple(b.shape)} {b.layout}"
        if a.is_sparse:
            if a.is_coalesced() != b.is_coalesced():
                return f"{where}: coalesced {a.is_coalesced()}, not {b.is_coalesced()}"
            return differs(a._indices(), b._indices(), f"{where} indices") or differs(a._values(), b._values(),
                                                                                      f"{where} values")
        tol = TOLERANCE.get(a.dtype)
        same = torch.equal(a, b) if tol is None else torch.allclose(a, b, rtol=tol[0], atol=tol[1], equal_nan=True)
        return "" if same else f"{where}: {_short(a)} != {_short(b)}"
    if type(a) is not type(b) or a != b:
        return f"{where}: {_short(a)} != {_short(b)}"
    return ""


@dataclass
class Pair:
    """A ringserve group and a gloo group of the same ranks (``ring`` None: the default group).

    ``members``: their global ranks, in group-rank order; ``me`` this rank's group rank;
    ``sample``: run every ``sample``-th case of the long lists only.
    """

    ring: Any
    gloo: Any
    members: list[int]
    rank: int
    sample: int = 1
    me: int = field(init=False)
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.me, self.n = self.members.index(self.rank), len(self.members)


@dataclass
class Recorder:
    """The checks of one rank: the names that passed, and why each failed one did."""

    rank: int
    prefix: str = ""
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)

    def under(self, prefix: str) -> Recorder:
        """A recorder into the same lists, its names prefixed (a subgroup's checks)."""
        return Recorder(self.rank, f"{prefix}: ", self.passed, self.failed, self.refusals)

    def check(self, name: str, ok: bool, why: str = "") -> None:
        if ok:
            self.passed.append(self.prefix + name)
        else:
            self.failed[self.prefix + name] = why or "failed"

    def expect(self, name: str, got: Any, want: Any) -> None:
        why = differs(got, want)
        self.check(name, not why, why)

    def differ(self, name: str, pair: Pair, call: Callable[[Any], Any], expect: Callable[[], Any] | None = None) -> None:
        """Runs ``call(group)`` on the ringserve group, then on the gloo one, and compares.

        Both give a result: they must be equal. gloo refuses: ringserve must refuse too, or, where
        ``expect`` says what ringserve gives instead, give that. ringserve refuses where gloo
        does not: a failure.
        """
        outcomes = []
        for run, group in ((on_device, pair.ring), (lambda c, g: c(g), pair.gloo)):
            try:
                outcomes.append((True, run(call, group)))
            except Exception as exc:
                outcomes.append((False, exc))
        (ring_ok, ring), (gloo_ok, gloo) = outcomes
        if isinstance(ring, LeftDevice):
            self.check(name, False, str(ring))
        elif ring_ok and gloo_ok:
            why = differs(ring, gloo)
            self.check(f"{name} equals gloo's", not why, why)
        elif gloo_ok:
            self.check(name, False, f"gloo gives {_short(gloo)}, but ringserve raised {type(ring).__name__}: {ring}")
        elif not ring_ok:
            self.refusals.append(f"{self.prefix}{name}: gloo {type(gloo).__name__}, ringserve {type(ring).__name__}")
            self.check(f"{name} is refused by both", True)
        elif expect is None:
            self.check(name, False, f"gloo refuses ({type(gloo).__name__}: {str(gloo)[:200]}), but ringserve gives "
                                    f"{_short(ring)}")
        else:
            why = differs(ring, expect())
            self.check(f"{name} (gloo refuses) gives what it should", not why, why)

    def better(self, name: str, pair: Pair, call: Callable[[Any], Any], expect: Callable[[], Any]) -> None:
        """Runs ``call(group)`` on the ringserve group only, where gloo refuses the call or cannot
        finish it (an int16 tensor, uneven sizes, recvs in another tag order than the sends),
        and checks what it gives against ``expect()``. (gloo's refusals of these are not all
        raised at the call, alike on every rank: some leave a peer waiting in gloo.)"""
        try:
            why = differs(on_device(call, pair.ring), expect())
        except Exception as exc:
            why = f"ringserve raised {type(exc).__name__}: {exc}"
        self.check(f"{name} (ringserve only) gives what it should", not why, why)

    def refused(self, name: str, pair: Pair, call: Callable[[Any], Any]) -> None:
        """Runs ``call(group)`` on the ringserve group only, which must refuse it at the call, as
        gloo refuses it for the dtypes it has (an op the dtype has not)."""
        try:
            on_device(call, pair.ring)
        except LeftDevice as exc:
            self.check(f"{name} (ringserve only) is refused", False, str(exc))
            return
        except (ValueError, RuntimeError) as exc:
            self.refusals.append(f"{self.prefix}{name}: ringserve {type(exc).__name__}")
            self.check(f"{name} (ringserve only) is refused", True)
            return
        self.check(f"{name} (ringserve only) is refused", False, "no error")

    def report(self) -> dict[str, Any]:
        return {"passed": self.passed, "failed": self.failed, "refused": self.refusals}
