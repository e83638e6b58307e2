"""What the status page draws, computed from the coordinator's Status answers alone.

Pure: no sockets, no clock. The page's server (http.py) samples Status once a second and keeps the
last minutes of samples; from them this module derives the two things one answer cannot say, each
edge's throughput and the commit and collective rates, and turns the newest answer into the JSON
the page renders (``snapshot``). Nothing here is a second source of truth: every number is Status's,
or a difference between two of its answers.

Which edges the page draws: the links the view's traffic uses now, not every link a worker ever
opened. A heartbeat carries each worker's links of its view with the bytes sent on each; a link
opens on first use and stays open for the view, so the links alone are every pair that ever sent:
the ring's pings and the agreement of the link measure (calibration.py) touch pairs that
``auto``'s halving-doubling never uses again, and a world of 4 shows 12 links where it exchanges
over 8. The plan itself is no better a source: ``auto`` plans per call by size (a ring for a large
tensor, halving-doubling for a small one, by host where the hosts say so), the coordinator sees
no call, and the union of the plans run lately is exactly the links whose bytes grew lately. So
an edge is drawn when its link sent within ``in_use_s`` of the view's newest traffic (``in_use``).
Measured against the newest traffic, not the clock, a stalled job keeps the edges it was using,
each at 0 B/s, rather than losing them all: which pairs wait is what its viewer needs to see.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ringserve._proto import coordinator_pb2 as pb

# Edge throughput is the bytes a link sent over about this many seconds of samples: long enough
# to smooth a step's bursts, short enough that a stalled edge drops to zero within a few polls.
EDGE_WINDOW_S = 5.0
# The chart plots one point per sample over this many seconds.
CHART_S = 300.0

LinkKey = tuple[str, int, int]  # (worker id, view id, peer rank)


@dataclass(frozen=True)
class Sample:
    """The numbers of one Status answer that rates are computed from."""

    t: float  # the coordinator's uptime
    commit: tuple[int, int] | None  # (lineage, step) of the job's mark
    collectives: int  # collectives done, summed over the members listed
    links: dict[LinkKey, int] = field(default_factory=dict)  # bytes sent per link
    # The time (``t``) each link was last seen sending: its bytes grew since the sample before, or
    # it appeared (a link opens on its first send).
    sent_at: dict[LinkKey, float] = field(default_factory=dict)


def sample(status: pb.StatusResponse, previous: Sample | None = None) -> Sample:
    """The sample of one answer, ``previous`` the sample before it (None: the first)."""
    links: dict[LinkKey, int] = {}
    sent_at: dict[LinkKey, float] = {}
    before = previous.links if previous is not None else {}
    before_at = previous.sent_at if previous is not None else {}
    for m in status.members:
        for link in m.counters.links:
            key = (m.member.worker_id, link.view_id, link.peer_rank)
            links[key] = link.bytes_sent
            grew = key not in before or link.bytes_sent != before[key] or key not in before_at
            sent_at[key] = status.uptime_s if grew else before_at[key]
    commit = (status.mark_lineage, status.mark_step) if status.HasField("mark_step") else None
    return Sample(status.uptime_s, commit, sum(m.counters.collectives_done for m in status.members), links, sent_at)


def in_use_s(heartbeat_interval_s: float) -> float:
    """How long after the view's newest traffic a link that sent still counts as used: the rate's
    window, or three heartbeats where they are further apart (a link's bytes move only when its
    worker's heartbeat arrives, and the coordinator stretches the interval in large worlds)."""
    return max(EDGE_WINDOW_S, 3 * heartbeat_interval_s)


def in_use(samples: list[Sample], keys: list[LinkKey], window_s: float) -> set[LinkKey]:
    """Those of ``keys`` (the current view's links) that sent within ``window_s`` of the newest
    traffic among them; all of them while no sample says when they sent."""
    if not samples:
        return set(keys)
    sent_at = samples[-1].sent_at
    known = [sent_at[k] for k in keys if k in sent_at]
    if not known:
        return set(keys)
    newest = max(known)
    return {k for k in keys if k not in sent_at or sent_at[k] >= newest - window_s - 1e-9}


def edge_rates(samples: list[Sample], window_s: float = EDGE_WINDOW_S) -> dict[LinkKey, float | None]:
    """Bytes per second of each link in the newest sample, over about ``window_s`` of samples;
    None for a link too new to have a rate."""
    if not samples:
        return {}
    last = samples[-1]
    rates: dict[LinkKey, float | None] = {}
    for key, sent in last.links.items():
        rates[key] = None
        for old in samples[:-1]:
            if last.t - old.t <= window_s + 1e-9 and key in old.links and last.t > old.t:
                rates[key] = max(0.0, (sent - old.links[key]) / (last.t - old.t))
                break
    return rates


def chart(samples: list[Sample], span_s: float = CHART_S) -> list[dict[str, float | None]]:
    """Commits and collectives per second between consecutive samples of the last ``span_s``.

    A commit rate is None where the mark is unknown or its lineage changed (a resume numbers
    commits anew); a collective rate that would be negative (a member left, taking its count with
    it) is clamped to zero.
    """
    if not samples:
        return []
    start = samples[-1].t - span_s
    points: list[dict[str, float | None]] = []
    for before, after in itertools.pairwise(samples):
        dt = after.t - before.t
        if after.t < start or dt <= 0:
            continue
        commits: float | None = None
        if before.commit is not None and after.commit is not None and before.commit[0] == after.commit[0]:
            commits = max(0.0, (after.commit[1] - before.commit[1]) / dt)
        points.append({"t": round(after.t, 3), "commits_per_s": commits,
                       "collectives_per_s": max(0.0, (after.collectives - before.collectives) / dt)})
    return points


def snapshot(status: pb.StatusResponse, samples: list[Sample]) -> dict[str, Any]:
    """The JSON the page renders: ``status`` (the newest answer) and what ``samples`` add to it."""
    rates = edge_rates(samples)
    view = status.view
    used = in_use(samples, [(m.member.worker_id, link.view_id, link.peer_rank) for m in status.members
                            for link in m.counters.links if link.view_id == view.view_id],
                  in_use_s(status.heartbeat_interval_s))
    members: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    for m in status.members:
        info = m.member
        links = list(m.counters.links)
        current = [link for link in links if link.view_id == view.view_id]
        members.append({
            "rank": info.rank, "worker_id": info.worker_id, "host": info.hostname, "address": info.address,
            "local_rank": info.local_rank, "lane": current[0].lane if current else "",
            "committed_step": m.committed_step if m.HasField("committed_step") else None,
            "committed_lineage": m.committed_lineage,
            "heartbeat_age_s": round(m.seconds_since_heartbeat, 3),
            "collectives": m.counters.collectives_done, "bytes_sent": m.counters.bytes_sent,
            "bytes_received": m.counters.bytes_received,
            "lane_bytes_sent": m.counters.lane_bytes_sent, "lane_fallbacks": m.counters.lane_fallbacks,
        })
        edges.extend(
            {"from": info.rank, "to": link.peer_rank, "lane": link.lane,
             "bytes_per_s": rates.get((info.worker_id, link.view_id, link.peer_rank))}
            for link in current if (info.worker_id, link.view_id, link.peer_rank) in used
        )
    return {
        "uptime_s": round(status.uptime_s, 3),
        "view_id": view.view_id,
        "view_size": status.view_size,
        "listed": len(members),
        "min_workers": status.min_workers,
        "max_workers": status.max_workers,
        "pending_workers": status.pending_workers,
        "views_formed": status.views_formed,
        "heartbeat_timeout_s": status.heartbeat_timeout_s,
        "heartbeat_interval_s": status.heartbeat_interval_s,
        "mark": {"step": status.mark_step, "lineage": status.mark_lineage} if status.HasField("mark_step") else None,
        "members": members,
        "edges": edges,
        "stalls": list(status.stall_warnings),
        "history": [{"at_s": round(e.at_s, 3), "kind": e.kind, "view_id": e.view_id, "text": e.text}
                    for e in status.history],
        "chart": chart(samples),
    }
