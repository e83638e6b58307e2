"""Halving-doubling and recursive doubling: collectives in 2 log2(p) and log2(p) steps.

Programs in the sense of programs/__init__.py (pure generators the executor runs), over the peers that
topology.py names. ``p`` is the largest power of two in the ring's size ``n``; the ``n - p``
others fold in first (topology.fold).

**Halving-doubling** (Rabenseifner's allreduce, MPICH's and gloo's ``halving_doubling``): the
vector is cut into ``p`` blocks, one per virtual rank. The reduce-scatter halves: at step s each
rank keeps half of the blocks it still holds and gives the other half, reduced so far, to its
partner at distance p / 2^(s+1), then reduces the partner's half of what it keeps. After log2(p)
steps virtual rank v holds block v fully reduced. The allgather doubles back: each rank sends
every finished block it holds to its partner at distance 1, 2, 4, ... Each rank sends
2 (p - 1) / p of the vector in 2 log2(p) steps: the ring's bytes, in logarithmic latency.

Pipelining: frames are chunks of blocks, keyed (step * p + block, chunk) in the reduce-scatter
and (gather + block, chunk) in the allgather. A chunk that arrives and is reduced leaves for the
next partner at once (a ``Fold`` to the next step) when it belongs to the half given next, so
chunks run ahead through the steps. At each step a rank takes its blocks in descending order of
``vrank XOR block`` (the blocks that leave it soonest first), which is exactly the order in which
its partner produced them: so a partner's frames arrive in the order they are waited for. In the
allgather each finished chunk is sent at once to every later partner (and to a folded rank), and
a rank takes its partner's blocks in the order that partner sends them (``gather_order``).

**Recursive doubling** (MPICH's allreduce for short messages): log2(p) steps; at step s each
rank sends its whole partial result to its partner at distance 2^s and reduces the partner's.
Half the steps of halving-doubling, log2(p) times the bytes: the small-message algorithm. Both
partners compute the same sum, with the operands in position order (partials.py), so every rank
ends with the same bytes.

**The fold** (both): a position that folds sends its whole vector to its partner first, and
receives the finished vector from it at the end (frames forwarded unchanged). Its partner reduces
the folded vector into its own as it arrives, chunk by chunk, and sends each chunk of its first
step on at once.

**The notice.** A rank that has joined (join.py) learns of the others' collectives from their
frames, so every rank must hear from some peer before it has to send: a partner's first step
does that, but a folded position hears from its partner only at the end. So the partner sends it
an empty frame first (``notice``), which it takes last, when it no longer waits for anything.
"""

from __future__ import annotations

from collections.abc import Iterator

from ringserve import topology
from ringserve.ring import chunk_bounds
from ringserve.worker.dataplane.programs import (
    NO_SEND,
    Bounds,
    Fold,
    Forward,
    Give,
    Lead,
    Own,
    Phase,
    Place,
    Program,
    Recv,
    Ring,
    Signal,
    Take,
)


def _chunks(bounds: Bounds, chunk_elems: int) -> Iterator[tuple[int, Bounds]]:
    yield from enumerate(chunk_bounds(*bounds, chunk_elems))


def kept(vrank: int, p: int, step: int) -> list[int]:
    """The blocks virtual rank ``vrank`` keeps at reduce-scatter ``step``, in the order it takes
    them: descending ``vrank XOR block``, the ones it gives away soonest first."""
    half = p >> (step + 1)
    base = vrank & ~(half - 1)
    return sorted(range(base, base + half), key=lambda b: -(vrank ^ b))


def given(vrank: int, p: int, step: int) -> list[int]:
    """The blocks virtual rank ``vrank`` gives its partner at reduce-scatter ``step``, in the
    order it sends them (the order the partner takes them in)."""
    return kept(vrank ^ (p >> (step + 1)), p, step)


def gather_order(vrank: int, step: int) -> list[int]:
    """The blocks virtual rank ``vrank`` sends its partner at allgather ``step`` (distance 2^step),
    in the order it sends them: its own, then those it got at each earlier step, in order."""
    order = [vrank]
    for earlier in range(step):
        order += gather_order(vrank ^ (1 << earlier), earlier)
    return order


def halving_doubling(ring: Ring, blocks: list[Bounds], chunk_elems: int, *, gather: bool = True) -> Program:
    """Reduce-scatter by halving, then (with ``gather``) allgather by doubling, of ``blocks`` (one
    per virtual rank: ``len(blocks)`` is the largest power of two in the ring's size).

    Without ``gather`` (a reduce-scatter, for a power-of-two ring only) position v ends with block
    v reduced and nothing else.
    """
    n, me = ring.size, ring.index
    p = topology.power_below(n)
    if len(blocks) != p:
        raise ValueError(f"Halving-doubling over {n} ranks takes {p} blocks, not {len(blocks)}.")
    if not gather and p != n:
        raise ValueError(f"A halving-doubling reduce-scatter needs a power-of-two ring, not {n} ranks.")
    if n == 1:
        for c, (a, b) in _chunks(blocks[0], chunk_elems):
            yield Own(NO_SEND, c, a, b, alone=True)
        return
    steps = p.bit_length() - 1
    gather_slot, fold_slot, notice = steps * p, (steps + 1) * p, (steps + 2) * p
    vrank, folded = topology.fold(n, me)
    if vrank < 0:  # this position folds into the next one: its vector goes there, the result comes back
        host = topology.fold(n, folded)[0]
        yield Phase("fold")
        for block in given(host, p, 0) + kept(host, p, 0):  # the order the host takes them in
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Lead(fold_slot + block, c, a, b, to=(folded,))
        yield Phase("allgather")
        for block in gather_order(host, steps):
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Recv(gather_slot + block, c, frm=folded)
                yield Take(a, b)
        yield Recv(notice, 0, frm=folded)
        return
    partners = [topology.partner(n, vrank, p >> (s + 1)) for s in range(steps)]
    doubling = partners[::-1]  # the allgather's partners, at distance 1, 2, 4, ...
    extra = (folded,) if folded >= 0 else ()

    # Step 0's sends: this rank's own input, or, with a folded partner, the sum of both.
    first = set(given(vrank, p, 0))
    if folded >= 0:
        yield Signal(notice, to=(folded,))  # see NOTICE
        yield Phase("fold")
        for block in given(vrank, p, 0) + kept(vrank, p, 0):
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Recv(fold_slot + block, c, frm=folded)
                yield Fold(block if block in first else NO_SEND, c, a, b, to=(partners[0],))
    else:
        for block in given(vrank, p, 0):
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Lead(block, c, a, b, to=(partners[0],))
    yield Phase("reduce_scatter")
    for s in range(steps):
        onward = set(given(vrank, p, s + 1)) if s + 1 < steps else set()
        for block in kept(vrank, p, s):
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Recv(s * p + block, c, frm=partners[s])
                if block in onward:
                    yield Fold((s + 1) * p + block, c, a, b, to=(partners[s + 1],))
                elif s + 1 < steps:
                    yield Fold(NO_SEND, c, a, b)
                elif gather:
                    yield Own(gather_slot + block, c, a, b, to=(*doubling, *extra))
                else:
                    yield Own(NO_SEND, c, a, b)
    if not gather:
        return
    yield Phase("allgather")
    for t, source in enumerate(doubling):
        later = (*doubling[t + 1:], *extra)
        for block in gather_order(vrank ^ (1 << t), t):
            for c, (a, b) in _chunks(blocks[block], chunk_elems):
                yield Recv(gather_slot + block, c, frm=source)
                yield Take(a, b)
                if later:
                    yield Forward(to=later)


def recursive_doubling(ring: Ring, total: int, chunk_elems: int) -> Program:
    """Allreduce of ``total`` elements by recursive doubling: log2(p) exchanges of the whole vector.

    Frames are keyed (step, chunk); a folded position's frames (fold, chunk) and its result's
    (result, chunk).
    """
    n, me = ring.size, ring.index
    chunks = chunk_bounds(0, total, chunk_elems)
    if n == 1:
        for c, (a, b) in enumerate(chunks):
            yield Own(NO_SEND, c, a, b, alone=True)
        return
    p = topology.power_below(n)
    steps = p.bit_length() - 1
    fold_slot, result_slot, notice = steps, steps + 1, steps + 2
    vrank, folded = topology.fold(n, me)
    if vrank < 0:
        yield Phase("fold")
        for c, (a, b) in enumerate(chunks):
            yield Lead(fold_slot, c, a, b, to=(folded,))
        yield Phase("result")
        for c, (a, b) in enumerate(chunks):
            yield Recv(result_slot, c, frm=folded)
            yield Take(a, b)
        yield Recv(notice, 0, frm=folded)
        return
    partners = [topology.partner(n, vrank, 1 << s) for s in range(steps)]
    if folded >= 0:
        yield Signal(notice, to=(folded,))  # see NOTICE
        yield Phase("fold")
        for c, (a, b) in enumerate(chunks):
            yield Recv(fold_slot, c, frm=folded)
            yield Fold(0, c, a, b, to=(partners[0],))
    else:
        for c, (a, b) in enumerate(chunks):
            yield Lead(0, c, a, b, to=(partners[0],))
    yield Phase("exchange")
    for s in range(steps):
        for c, (a, b) in enumerate(chunks):
            yield Recv(s, c, frm=partners[s])
            if s + 1 < steps:
                yield Fold(s + 1, c, a, b, to=(partners[s + 1],))
            elif folded >= 0:
                yield Own(result_slot, c, a, b, to=(folded,))
            else:
                yield Own(NO_SEND, c, a, b)


def allgather_doubling(ring: Ring, total: int, chunk_elems: int) -> Program:
    """Allgather by doubling of blocks whose sizes differ by position (this one's has ``total``),
    over a power-of-two ring: log2(n) steps. Frames are keyed by origin, as in
    programs.allgather_blocks, and a block's size travels in each of its frames."""
    n, me = ring.size, ring.index
    if n & (n - 1):
        raise ValueError(f"An allgather by doubling needs a power-of-two ring, not {n} ranks.")
    if n == 1:
        return
    steps = n.bit_length() - 1
    doubling = [topology.partner(n, me, 1 << t) for t in range(steps)]
    for c, (a, b) in _chunks((0, total), chunk_elems):
        yield Give(me, c, me, a, b, total, to=tuple(doubling))
    for t, source in enumerate(doubling):
        later = tuple(doubling[t + 1:])
        for origin in gather_order(me ^ (1 << t), t):
            size = yield Recv(origin, 0, frm=source)
            assert size is not None
            if t == 0 and origin == me ^ 1:
                yield Phase("allgather")
            for c, (a, b) in _chunks((0, size), chunk_elems):
                if c:
                    yield Recv(origin, c, frm=source)
                yield Place(origin, a, b, size)
                if later:
                    yield Forward(to=later)


def host_doubling(ring: Ring, local: int, total: int, chunk_elems: int) -> Program:
    """Allreduce of ``total`` elements by host, as one program, for vectors whose time is latency:
    over a ring whose hosts hold ``local`` consecutive positions each, a host's other positions
    send their vectors to its first (its leader), the leaders run recursive doubling among
    themselves (with its fold where the hosts are not a power of two), and each leader sends the
    result to its host's positions. MPICH's SMP-aware allreduce for short messages.

    Against the three stages of worker/ops/hierarchy.py (a reduce-scatter within each host, one
    allreduce across hosts per local position, an allgather within each host), the bytes on a
    host's uplink are the same (one rank sends the whole vector where ``local`` ranks sent a slice
    each), the hops are the same, and a rank sends and receives half as many frames or fewer, in
    one collective instead of three: on hosts whose cores every rank shares, that CPU is the time.

    Frames are keyed (k, chunk) for position k of a host (1 <= k < local) to its leader, (0, chunk)
    for the result (to a host's positions and to a folded leader), (local + s, chunk) for step s of
    the doubling and (local + steps, chunk) for a leader that folds into another. Operands are
    reduced in position order (partials.py): a leader takes its host's vectors in order, and both
    partners of a step compute the same sum, so every rank ends with the same bytes.
    """
    n, me = ring.size, ring.index
    if local < 1 or n % local:
        raise ValueError(f"A ring of {n} positions has no hosts of {local} consecutive positions each.")
    chunks = chunk_bounds(0, total, chunk_elems)
    host, offset = divmod(me, local)
    leader = host * local
    if offset:
        yield Phase("fold")
        for c, (a, b) in enumerate(chunks):
            yield Lead(offset, c, a, b, to=(leader,))
        yield Phase("result")
        for c, (a, b) in enumerate(chunks):
            yield Recv(0, c, frm=leader)
            yield Take(a, b)
        return
    hosts = n // local
    members = tuple(range(leader + 1, leader + local))
    p = topology.power_below(hosts)
    steps = p.bit_length() - 1
    vrank, folded = topology.fold(hosts, host)
    fold_slot = local + steps
    if vrank < 0:  # this host's sum goes to another leader, and the result comes back from it
        yield Phase("fold")
        for c, (a, b) in enumerate(chunks):
            yield from _host_sum(members, c, a, b, fold_slot, (folded * local,))
        yield Phase("result")
        for c, (a, b) in enumerate(chunks):
            yield Recv(0, c, frm=folded * local)
            yield Take(a, b)
            if members:
                yield Forward(to=members)
        return
    partners = [topology.partner(hosts, vrank, 1 << s) * local for s in range(steps)]
    result_to = ((folded * local,) if folded >= 0 else ()) + members
    yield Phase("fold")
    for c, (a, b) in enumerate(chunks):
        if not steps:  # one host: its leader finishes the sum
            if members:
                yield from _host_sum(members[:-1], c, a, b, NO_SEND, ())
                yield Recv(len(members), c, frm=members[-1])
                yield Own(0, c, a, b, to=members)
            else:
                yield Own(NO_SEND, c, a, b, alone=True)
        elif folded >= 0:
            yield from _host_sum(members, c, a, b, NO_SEND, ())
            yield Recv(fold_slot, c, frm=folded * local)
            yield Fold(local, c, a, b, to=(partners[0],))
        else:
            yield from _host_sum(members, c, a, b, local, (partners[0],))
    yield Phase("exchange")
    for s in range(steps):
        for c, (a, b) in enumerate(chunks):
            yield Recv(local + s, c, frm=partners[s])
            if s + 1 < steps:
                yield Fold(local + s + 1, c, a, b, to=(partners[s + 1],))
            else:
                yield Own(0 if result_to else NO_SEND, c, a, b, to=result_to)


def _host_sum(members: tuple[int, ...], c: int, a: int, b: int, slot: int, to: tuple[int, ...]) -> Program:
    """A leader's sum of chunk ``c`` over its host: each member's frame reduced in position order,
    the last sent on as (``slot``, c) to ``to`` (NO_SEND: kept here to be reduced again). Without
    members, this rank's own vector goes (a Lead) unless it is kept."""
    if not members:
        if slot != NO_SEND:
            yield Lead(slot, c, a, b, to=to)
        return
    for k, member in enumerate(members, start=1):
        yield Recv(k, c, frm=member)
        yield Fold(slot if k == len(members) else NO_SEND, c, a, b, to=to if k == len(members) else ())
