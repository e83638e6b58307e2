"""The executor: runs any program (programs.py) on a session, once for all collectives.

It owns what every collective needs and no program should know: the deadline, the opening and
release of the collective on the session (its key, its inbox, the mismatch and abort protocol),
the timeline span and its phases, the confirmation lap when checksums are on, and backpressure
(it waits for room on the link before each send). Sends never wait for a receive: chunk c of step
s + 1 leaves as soon as chunk c of step s has arrived and been reduced, whatever else is pending.

Every frame names its sender's arguments (the descriptor), so a rank whose arguments differ is
caught by its successor at the first step, and every step carries at least one frame (an empty one
for an empty segment), which is what lets each rank check its predecessor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np

from ringserve.errors import CollectiveTimeoutError, ProtocolError
from ringserve.observe import Span
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import (
    NO_SEND,
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
from ringserve.worker.dataplane.session import Inbox, Received, Session
from ringserve.worker.dataplane.values import Values


def ring_of(session: Session) -> Ring:
    """The ring the session runs over: every rank of its view, or a sub-ring (see session.py)."""
    return session.ring


async def run(session: Session, name: str | None, descriptor: Descriptor, timeout_s: float, program: Program,
              values: Values, *, key: str | None = None) -> str:
    """Runs one collective's program under its deadline, counts it, and forgets its frames afterwards.

    ``key``: the collective's key, when this rank stands in for a collective of the others that it
    learned of from their frames (see join.py); otherwise the session makes it from ``name``.
    Returns the collective's key. The results are in ``values``.
    """
    return await run_stages(session, name, descriptor, timeout_s, iter([(program, values)]), key=key)


async def run_stages(session: Session, name: str | None, descriptor: Descriptor, timeout_s: float,
                     stages: Iterator[tuple[Program, Values]], *, key: str | None = None) -> str:
    """Runs a collective made of several programs, one after the other, under one key and deadline.

    ``stages`` gives each program with its values once the one before has finished (so a stage may
    compute its values from the results of the last): a collective that needs rounds of
    communication with computation between them (Adasum) is still one collective, with one name,
    one descriptor and one timeline span. Each stage must use slots of its own (programs.shifted).
    """
    text, kind = descriptor.text, descriptor.kind
    key, inbox = session.open(name, text, key=key)
    span = inbox.span = Span(session.timeline, session.counters, f"{kind} {key}", {
        "op": kind, "op_key": key, "descriptor": text, "view": session.view_id, "rank": session.plane.place.rank,
    })
    ok = False
    values = Values()
    try:
        # NaN and Inf are data here (check_finite reports them): inf - inf in a sum must not warn,
        # or, under -W error, raise on one rank in the middle of the ring. numpy keeps this
        # setting per task (a context variable), so it covers this collective only.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            async with asyncio.timeout(timeout_s):
                for program, values in stages:
                    values.key = key
                    try:
                        await execute(session, key, inbox, program, values)
                    finally:
                        program.close()
                if session.checksum:
                    await execute(session, key, inbox, programs.confirm(ring_of(session)), values)
        ok = True
    except TimeoutError:
        raise CollectiveTimeoutError(
            f"Collective {key!r} ({text}) did not finish within {timeout_s:g} s on rank "
            f"{session.plane.place.rank} of view {session.view_id}."
        ) from None
    finally:
        session.release(key)
        elapsed = span.end(ok)
    session.counters.observe(kind, elapsed)
    return key


async def execute(session: Session, key: str, inbox: Inbox, program: Program, values: Values) -> None:
    """Carries out every step of ``program`` for the collective ``key``.

    Steps that use a frame use the last one received; a program that uses one before it received
    any, or takes a step its data has not (values.py), fails with ProtocolError.
    """
    frame: Received | None = None
    reply: int | None = None
    send, has_room = session.send, session.has_room
    dtype, codec = values.dtype, values.codec
    while True:
        try:
            step = program.send(reply)
        except StopIteration:
            return
        reply = None
        match step:  # the most frequent steps first
            case Recv(slot, chunk):
                frame = await session.recv(key, inbox, slot, chunk)
                reply = frame.header.origin_count
            case Take(a, b):
                values.take(a, b, _held(frame, step, key))
            case Fold(slot, chunk, a, b):
                payload = values.pass_on(a, b, values.reduce(a, b, _held(frame, step, key)))
                if not has_room():
                    await _room(session)
                send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a, codec=codec)
            case Forward():
                held = _held(frame, step, key)
                if not has_room():
                    await _room(session)
                session.forward(held)
            case Own(slot, chunk, a, b, alone):
                part = values.alone(a, b) if alone else values.reduce(a, b, _held(frame, step, key))
                done = values.own(a, b, part)
                if slot != NO_SEND:
                    if not has_room():
                        await _room(session)
                    send(key, inbox, slot=slot, chunk=chunk, payload=done, dtype=dtype, count=b - a, codec=codec)
            case Lead(slot, chunk, a, b):
                payload = values.first(a, b)
                if not has_room():
                    await _room(session)
                send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a, codec=codec)
            case Give(slot, chunk, origin, a, b, total):
                payload = values.block(origin)[a:b]
                if not has_room():
                    await _room(session)
                send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a,
                     origin=origin, origin_count=total)
            case Place(origin, a, b, total):
                values.place(origin, a, b, total, _held(frame, step, key))
            case Signal(slot):
                if not has_room():
                    await _room(session)
                send(key, inbox, slot=slot, chunk=0, payload=b"", dtype=dtype, count=0)
            case Phase(name):
                if inbox.span is not None:
                    inbox.span.phase(name)
            case _:
                raise ProtocolError(f"The program of collective {key!r} took an unknown step {step!r}.")


async def _room(session: Session) -> None:
    """Waits until the link to the successor takes another frame (see link.py)."""
    while not session.has_room():
        await session.room()


def _held(frame: Received | None, step: object, key: str) -> Received:
    if frame is None:
        raise ProtocolError(f"The program of collective {key!r} took the step {step!r} before receiving a frame.")
    return frame
