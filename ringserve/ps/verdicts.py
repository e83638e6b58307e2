"""A shard's verdicts on the wire, told apart from gRPC's own errors: which failed calls a client
asks again, and which it raises.

A failed call's status comes from one of two places. The shard's servicer decides some (bad
input, no job, a wait that ran out: see shard/service.py), and gRPC decides the others, on either side,
when the connection or the stream breaks under the call: UNAVAILABLE, and also INTERNAL ("Internal
error from Core" when a reset finds the client sending, "Stream removed" when the peer resets the
stream), CANCELLED (the peer or its transport cancelled the stream: a caller's own cancellation
raises ``asyncio.CancelledError``, never a status) and UNKNOWN (a server that died with the call
open). A worker died of issue 40's INTERNAL while a killed shard restarted: a broken transport,
not a verdict.

The rule: the servicer sends every verdict with the trailing metadata ``ringserve-verdict``
(``refuse``), and a client asks again, within ``shard_wait_s``,

- any UNAVAILABLE, the servicer's own included ("starting": come back), and
- INTERNAL, CANCELLED and UNKNOWN that carry no verdict marker.

Everything else is raised at once. The rule rests on the marker, which only a servicer that
answered can send, and not on the details' wording, which gRPC's versions change (no transport
failure ever carries the marker, and no verdict lacks it; a shard of a version before the marker
never refused with these three codes either). The cost is bounded: an unhandled exception in the
servicer (a shard's bug) comes as UNKNOWN without the marker, as does an INTERNAL of the client's
own gRPC that is no transport failure (an answer it cannot parse); each is asked again until
``shard_wait_s`` runs out, and raised as ShardUnavailableError naming it.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

# The trailing metadata key of a shard's verdicts (lower case, as gRPC requires).
VERDICT_KEY = "ringserve-verdict"
# What gRPC's library gives a call whose connection or stream broke, besides UNAVAILABLE.
BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Ends a call with the shard's verdict: ``code`` and ``details``, marked as the shard's own."""
    await context.abort(code, details, trailing_metadata=((VERDICT_KEY, "1"),))
    raise AssertionError("abort returns only by raising")


def is_verdict(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the status came from a shard's servicer (``refuse``), not from gRPC itself."""
    return any(key == VERDICT_KEY for key, _ in exc.trailing_metadata() or ())


def is_transient(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call is asked again once the shard is listed alive (see the module)."""
    code = exc.code()
    return code == grpc.StatusCode.UNAVAILABLE or (code in BROKEN and not is_verdict(exc))
