"""A collective's descriptor: what every frame of it says of the arguments its sender passed.

Ranks must agree on a collective's arguments (its kind, dtype, shape, op, codec, root, ...). Each
frame carries its sender's descriptor as text, and a rank whose own differs fails the collective
with MismatchError on every rank (see plane.py and aborts.py), naming each rank's descriptor. So
the text is a protocol between ranks, and the error messages that users read show it.

``Descriptor`` is that protocol's one definition: a frozen value, its encoding (``text``) and its
parsing (``Descriptor.parse``), here and nowhere else. The data plane compares the texts only
(one string comparison per frame); a joined rank (ops/join.py) parses the others' descriptors to
decide how to stand in for their collectives.

The encoding, a field at a time and in this order, each only when set:

```python
allreduce float32 (4, 3) op=average codec=int8
allreduce float32 (8,) op=adasum parts=(5, 3)
allreduce float32 (8,) op=sum stage=cross invalid: an earlier stage of this hierarchical allreduce failed
allreduce float32 (1024,) op=sum algo=tree    an algorithm other than the ring (routes.py)
broadcast int64 (3,) root=1
allgather float32 (*, 17, 17)          rows: the shape after a first dimension ranks may differ in
message float64 x5                     count: a message's number of elements
grouped_reduce_scatter float32 [float32 (4, 3); int64 (5,)] op=sum
barrier
```

``kind`` is the first word; ``invalid: ...`` (``problem``) names why a rank refuses the collective
(see ops/refusal.py); ``algo=...`` names the algorithm when it is not the ring (routes.py), so ranks
that chose differently disagree on the descriptor.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ringserve.errors import ProtocolError

__all__ = ["Descriptor", "Shape"]

Shape = tuple[int, ...]

_SHAPE = r"\((?:\d+(?:, \d+)*,?)?\)"  # (), (4,), (4, 3)
_ROWS = r"\(\*, (?:\d+(?:, \d+)*)?\)"  # (*, ), (*, 3), (*, 17, 17)
_KEYS = r"(?!op=|codec=|root=|parts=|stage=|algo=|invalid: )"
_ARRAY = rf"(?P<dtype>[a-z][a-z0-9_]*)(?: (?P<shape>{_SHAPE}))?(?: (?P<rows>{_ROWS}))?"
_TEXT = re.compile(
    rf"(?P<kind>[a-z_]+)"
    rf"(?: {_KEYS}{_ARRAY})?"
    rf"(?: x(?P<count>\d+))?"
    rf"(?: \[(?P<items>[^\[\]]*)\])?"
    rf"(?: op=(?P<op>\S+))?"
    rf"(?: codec=(?P<codec>\S+))?"
    rf"(?: root=(?P<root>\d+))?"
    rf"(?: parts=(?P<parts>{_SHAPE}))?"
    rf"(?: stage=(?P<stage>\S+))?"
    rf"(?: algo=(?P<algo>\S+))?"
    rf"(?: invalid: (?P<problem>.*))?",
    re.DOTALL,
)
_ITEM = re.compile(_ARRAY)


def _shape_text(shape: Shape) -> str:
    return str(tuple(shape))


def _shape_of(text: str | None) -> Shape | None:
    if text is None:
        return None
    inner = text.strip("()").removeprefix("*").strip(", ")
    return tuple(int(n) for n in inner.split(", ") if n.strip(","))


@dataclass(frozen=True)
class Descriptor:
    """A collective's arguments as ranks must agree on them.

    Example:
        ```python
        >>> Descriptor("allreduce", dtype="float32", shape=(4,), op="sum").text
        'allreduce float32 (4,) op=sum'
        >>> Descriptor.parse("broadcast int64 (3,) root=1").root
        1
        ```
    """

    kind: str
    dtype: str = ""
    shape: Shape | None = None  # the whole shape
    rows: Shape | None = None  # the shape after the first dimension, which may differ by rank
    count: int | None = None  # a message's number of elements
    items: tuple[Descriptor, ...] = ()  # a grouped collective's arrays (dtype and shape or rows each)
    op: str = ""
    codec: str = ""  # the wire codec's name ("": none)
    root: int | None = None
    parts: Shape | None = None  # Adasum: the element counts of the tensors fused in the array
    stage: str = ""  # a stage of a collective made of several (hierarchy.py, join's last lap)
    algo: str = ""  # the algorithm it runs when not the ring (routes.py, selection.py)
    problem: str = ""  # why this rank refuses the collective ("": it does not)
    text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", self._encode())

    def _encode(self) -> str:
        words = [self.kind] if self.kind else []
        if self.dtype:
            words.append(self.dtype)
        if self.shape is not None:
            words.append(_shape_text(self.shape))
        if self.rows is not None:
            words.append(f"(*, {', '.join(map(str, self.rows))})")
        if self.count is not None:
            words.append(f"x{self.count}")
        if self.items:
            words.append(f"[{'; '.join(item.text for item in self.items)}]")
        if self.op:
            words.append(f"op={self.op}")
        if self.codec:
            words.append(f"codec={self.codec}")
        if self.root is not None:
            words.append(f"root={self.root}")
        if self.parts is not None:
            words.append(f"parts={_shape_text(self.parts)}")
        if self.stage:
            words.append(f"stage={self.stage}")
        if self.algo:
            words.append(f"algo={self.algo}")
        if self.problem:
            words.append(f"invalid: {self.problem}")
        return " ".join(words)

    def __str__(self) -> str:
        return self.text

    def refused(self, problem: str) -> Descriptor:
        """This descriptor, refused by a rank for ``problem`` (a mismatch for every other rank)."""
        return changed(self, "problem", problem)

    def at_stage(self, stage: str) -> Descriptor:
        """The descriptor of one stage of this collective."""
        return changed(self, "stage", stage)

    @classmethod
    def parse(cls, text: str) -> Descriptor:
        """The descriptor whose encoding is ``text``: ``Descriptor.parse(d.text) == d``.

        Raises:
            ProtocolError: ``text`` is no descriptor's encoding (a peer sent something else).
        """
        match = _TEXT.fullmatch(text)
        items = () if match is None or match["items"] is None else tuple(_item(t) for t in match["items"].split("; "))
        if match is None or None in items:
            raise ProtocolError(f"{text!r} is not a collective's descriptor.")
        parsed = cls(
            kind=match["kind"], dtype=match["dtype"] or "", shape=_shape_of(match["shape"]),
            rows=_shape_of(match["rows"]), count=None if match["count"] is None else int(match["count"]),
            items=tuple(i for i in items if i is not None), op=match["op"] or "", codec=match["codec"] or "",
            root=None if match["root"] is None else int(match["root"]), parts=_shape_of(match["parts"]),
            stage=match["stage"] or "", algo=match["algo"] or "", problem=match["problem"] or "",
        )
        if parsed.text != text:
            raise ProtocolError(f"{text!r} is not a collective's descriptor as ranks write them ({parsed.text!r}).")
        return parsed


@functools.lru_cache(maxsize=1024)
def changed(descriptor: Descriptor, name: str, value: str) -> Descriptor:
    """``descriptor`` with its field ``name`` set to ``value``, remembered: every call of a training
    loop builds the same descriptors, and each stage or algorithm named costs a new one
    (``dataclasses.replace`` and the text's encoding, about a tenth of a small allreduce's time
    by host)."""
    changes: dict[str, Any] = {name: value}
    return replace(descriptor, **changes)


def _item(text: str) -> Descriptor | None:
    match = _ITEM.fullmatch(text)
    if match is None:
        return None
    return Descriptor("", dtype=match["dtype"], shape=_shape_of(match["shape"]), rows=_shape_of(match["rows"]))
