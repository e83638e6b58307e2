"""The executor: runs any program (programs/__init__.py) on a session, once for all collectives.

It owns what every collective needs and no program should know: the deadline, the opening and
release of the collective on the session (its key, its inbox, the mismatch and abort protocol),
the timeline span and its phases, the confirmation lap when checksums are on, and backpressure
(it waits for room on the link before each send). Sends never wait for a receive: chunk c of step
s + 1 leaves as soon as chunk c of step s has arrived and been reduced, whatever else is pending.

A stage may be several programs at once (``programs.Programs``: a pipelined tree's climb and
descent), carried out concurrently over the same frames and values; the first to fail fails all.

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
from ringserve.worker.dataplane import programs, routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import (
    NO_SEND,
    Fold,
    Forward,
    Give,
    Land,
    Lead,
    Own,
    Phase,
    Place,
    Program,
    Programs,
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


async def run(session: Session, name: str | None, descriptor: Descriptor, timeout_s: float, program: Programs,
              values: Values, *, key: str | None = None) -> str:
    """Runs one collective's program under its deadline, counts it, and forgets its frames afterwards.

    ``key``: the collective's key, when this rank stands in for a collective of the others that it
    learned of from their frames (see join.py); otherwise the session makes it from ``name``.
    Returns the collective's key. The results are in ``values``.
    """
    return await run_stages(session, name, descriptor, timeout_s, iter([(program, values)]), key=key)


async def run_stages(session: Session, name: str | None, descriptor: Descriptor, timeout_s: float,
                     stages: Iterator[tuple[Programs, Values]], *, key: str | None = None) -> str:
    """Runs a collective made of several programs, one after the other, under one key and deadline.

    ``stages`` gives each program with its values once the one before has finished (so a stage may
    compute its values from the results of the last): a collective that needs rounds of
    communication with computation between them (Adasum) is still one collective, with one name,
    one descriptor and one timeline span. Each stage must use slots of its own (programs.shifted).
    """
    text, kind = descriptor.text, descriptor.kind
    algorithm = routes.algorithm_of(descriptor)
    key, inbox = session.open(name, text, key=key)
    span = inbox.span = Span(session.timeline, session.counters, f"{kind} {key}", {
        "op": kind, "op_key": key, "descriptor": text, "view": session.view_id, "rank": session.plane.place.rank,
        "algorithm": algorithm,
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
                    await _execute_all(session, key, inbox, program, values)
                    await session.flushed()  # the TCP lane sends from the buffers (lanes/tcp/outbound.py)
                if session.checksum:
                    await execute(session, key, inbox, programs.confirm(ring_of(session)), values)
        ok = True
    except TimeoutError:
        raise CollectiveTimeoutError(
            f"Collective {key!r} ({text}) did not finish within {timeout_s:g} s on rank "
            f"{session.plane.place.rank} of view {session.view_id}."
        ) from None
    finally:
        try:
            await session.withdraw(key)  # waits only while a lane's thread reads into the values
        finally:  # even if that wait is cancelled
            session.release(key)
            elapsed = span.end(ok)
    session.counters.observe(kind, elapsed, algorithm)
    return key


async def _execute_all(session: Session, key: str, inbox: Inbox, program: Programs, values: Values) -> None:
    """Carries out a program, or several at once (a tuple: a tree's two directions, see
    programs/trees.py), over the same frames and values; the first to fail fails them all."""
    if not isinstance(program, tuple):
        try:
            await execute(session, key, inbox, program, values)
        finally:
            program.close()
        return
    try:
        async with asyncio.TaskGroup() as group:
            for one in program:
                group.create_task(execute(session, key, inbox, one, values))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    finally:
        for one in program:
            one.close()


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
            case Recv(slot, chunk, frm):
                frame = await session.recv(key, inbox, slot, chunk, frm)
                reply = frame.header.origin_count
            case Take(a, b):
                values.take(a, b, _held(frame, step, key))
            case Fold(slot, chunk, a, b, to):
                part = values.reduce(a, b, _held(frame, step, key))
                if slot != NO_SEND:
                    payload = values.pass_on(a, b, part)
                    if not has_room(to):
                        await _room(session, to)
                    send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a, codec=codec,
                         to=to)
            case Forward(to):
                held = _held(frame, step, key)
                if not has_room(to):
                    await _room(session, to)
                session.forward(held, to)
            case Own(slot, chunk, a, b, alone, to):
                part = values.alone(a, b) if alone else values.reduce(a, b, _held(frame, step, key))
                done = values.own(a, b, part)
                if slot != NO_SEND:
                    if not has_room(to):
                        await _room(session, to)
                    send(key, inbox, slot=slot, chunk=chunk, payload=done, dtype=dtype, count=b - a, codec=codec,
                         to=to)
            case Lead(slot, chunk, a, b, to):
                payload = values.first(a, b)
                if not has_room(to):
                    await _room(session, to)
                send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a, codec=codec, to=to)
            case Give(slot, chunk, origin, a, b, total, to):
                payload = values.block(origin)[a:b]
                if not has_room(to):
                    await _room(session, to)
                send(key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=b - a,
                     origin=origin, origin_count=total, to=to)
            case Place(origin, a, b, total):
                values.place(origin, a, b, total, _held(frame, step, key))
            case Signal(slot, to):
                if not has_room(to):
                    await _room(session, to)
                send(key, inbox, slot=slot, chunk=0, payload=b"", dtype=dtype, count=0, to=to)
            case Phase(name):
                if inbox.span is not None:
                    inbox.span.phase(name)
            case Land(frames):
                session.land(key, [(slot, chunk, region) for slot, chunk, a, b in frames
                                   if (region := values.landing(a, b)) is not None], dtype)
            case _:
                raise ProtocolError(f"The program of collective {key!r} took an unknown step {step!r}.")


async def _room(session: Session, to: tuple[int, ...]) -> None:
    """Waits until the links to ``to`` (the successor when empty) take another frame (see links/stream.py)."""
    while not session.has_room(to):
        await session.room(to)


def _held(frame: Received | None, step: object, key: str) -> Received:
    if frame is None:
        raise ProtocolError(f"The program of collective {key!r} took the step {step!r} before receiving a frame.")
    return frame
