"""Silence and death: when a silent worker is removed, and how deaths found together leave in one view.

The decisions behind membership.py's **Failure** rule, pure and clock-injected like the rest of the
state machine: ``step`` calls them on ``Tick`` (and on the answer to a silent worker's or the
sweep's probe), and carries out the probes and removals they return.

A worker silent for ``heartbeat_timeout_s``, or a suspect whose probe failed, is removed, and a
view without it is published; a worker is never declared dead for silence shorter than the full
timeout. With a grace (``silence_grace_s``), a worker silent for the timeout is first probed:
silence cannot tell a process that is gone from one that is stopped or starved of CPU (a GC
pause, a noisy neighbour), but a probe can. A process that is gone refuses the probe at once and
is removed then; one that heartbeats again within the grace stays; one that does not is removed
when the grace is up. Only a heartbeat keeps a worker: one that answers the probe but cannot reach
the coordinator (its route cut) is still removed, so that its peers go on without it. So a stall
of up to about ``heartbeat_timeout_s + silence_grace_s`` less an interval is never taken for a
death. A peer's report is held to the same bound (:func:`silent_past_bound`): a reported worker
whose probe gets no answer in time is probed again, and removed only once silent past it.

Workers that died together (a host, a rack) sent their last heartbeats over an interval, and would
expire over as many ticks, each a view that every rank must install. So when some have expired
while others are nearly silent (for more than ``heartbeat_timeout_s - failure_window_s``), the
probe (or, without a grace, the view) waits, at most ``failure_window_s``, until each of those has
either spoken again or expired too (:func:`expire`). And deaths found apart (a peer's report, a
refused probe, a grace run out) are gathered by a **sweep** (``sweep_s``, see
:func:`settle_deaths`): the first death found probes every worker silent for more than an
interval at once, and every death found within ``sweep_s`` leaves in the same view. A death is
published within ``heartbeat_timeout_s`` (a process gone; sooner if a peer reports it) or
``heartbeat_timeout_s + silence_grace_s`` (a host gone, a wedged worker) of its last heartbeat,
plus ``sweep_s`` and a tick. Silence while the coordinator itself did not run is not counted
against the workers (:func:`forgive_stall`).
"""

from __future__ import annotations

from dataclasses import replace

from ringserve.coordinator import pacing
from ringserve.coordinator.roster import INF, Action, Probe, ProbeResult, Removed, State, remove_all, seen


def heartbeat_interval(state: State) -> float:
    """The interval the workers are told to heartbeat at now (see ringserve.coordinator.pacing)."""
    rules = state.rules
    return pacing.heartbeat_interval(
        rules.heartbeat_interval_s, rules.heartbeat_timeout_s, rules.max_heartbeats_per_s, len(state.workers)
    )


def _failure_window(state: State) -> float:
    """failure_window_s, or longer when the interval is stretched: a stretched interval spreads
    the last heartbeats of workers that died together over more time."""
    rules = state.rules
    if rules.max_heartbeats_per_s <= 0:
        return rules.failure_window_s
    return max(rules.failure_window_s, pacing.failure_window(heartbeat_interval(state), rules.heartbeat_timeout_s))


def forgive_stall(state: State, now: float) -> State:
    """After a gap between ticks longer than ``stall_s``, the coordinator did not run, and heard
    nothing, through no worker's fault: every worker's silence is moved on by the gap, so that
    only silence while the coordinator listened counts. Without it, a coordinator stalled past the
    heartbeat timeout (its process stopped, or starved on a loaded machine) declared every worker
    dead the moment it ran again, and formed a view of none (issue 40)."""
    gap = now - state.ticked_at
    if state.ticked_at == -INF or gap <= state.rules.stall_s:
        return state
    last_seen = {wid: min(now, at + gap) for wid, at in seen(state).items()}
    # Probes that ended while the coordinator did not run (their deadlines passed in its stall)
    # say nothing either: the silence they were about is forgiven, and judged again from here.
    return replace(state, last_seen=last_seen, beats=None, silent_probes={}, sweep={}, found_dead={}, dead_since=INF)


def expire(state: State, now: float) -> tuple[State, list[Action]]:
    """Folds the heartbeats in, and removes the workers silent past the timeout, all in one view,
    once none is left nearly silent (or failure_window_s has passed since some expired)."""
    last_seen = seen(state)
    if state.beats is not None:
        state = replace(state, last_seen=last_seen, beats=None)
    deadline = state.rules.heartbeat_timeout_s
    probing = state.silent_probes
    if not any(now - at > deadline and wid not in probing for wid, at in last_seen.items()):
        if state.expiring_since != INF:
            # The expired spoke again (a slow worker, not a dead one): the wait is over, and a
            # later failure gets a window of its own.
            state = replace(state, expiring_since=INF)
        return state, []
    expiring_since = min(state.expiring_since, now)
    window = _failure_window(state)
    if now - expiring_since < window:
        nearly = deadline - window
        if any(nearly < now - at <= deadline for at in last_seen.values()):
            return replace(state, expiring_since=expiring_since), []
    silent = [wid for wid, at in last_seen.items() if now - at > deadline and wid not in probing]
    grace = state.rules.silence_grace_s
    if grace > 0:
        # Probed first (see the module docstring); settle_deaths removes those found gone.
        probes = {**probing, **dict.fromkeys(silent, now)}
        state = replace(state, silent_probes=probes, expiring_since=INF)
        return state, [Probe(wid, state.workers[wid].address, silent=True, timeout_s=grace, began=now)
                       for wid in silent]
    state = replace(remove_all(state, silent, now, failed=True), expiring_since=INF)
    return state, [Removed(wid, f"silent for more than {deadline:g} s") for wid in silent]


def silent_past_bound(state: State, worker_id: str, now: float) -> bool:
    """Whether ``worker_id`` has been silent longer than the silence rule forgives: the heartbeat
    timeout and, with a grace, the grace too. A peer's report, with a probe that got no answer in
    time, removes a worker only then: before it, the worker may be a process starved of CPU,
    whose links to its peers broke while it did not run (256 workers on 2 cores: one such worker
    was removed 6.3 s after its last heartbeat, and the job lost it)."""
    bound = state.rules.heartbeat_timeout_s + state.rules.silence_grace_s
    return now - seen(state).get(worker_id, -INF) > bound


def silent_answered(state: State, event: ProbeResult) -> State:
    """The probe of a silent worker, or the sweep's, ended. A refusal finds the worker dead (it
    waits in ``found_dead`` for settle_deaths, which removes the dead together). An answer, or
    none within the deadline, decides nothing: only a heartbeat keeps a silent worker (an answer
    proves the process runs, not that the coordinator hears it), and the grace, counted on the
    coordinator's own clock, ends it. The answer to a probe no longer waited for is stale, and
    says nothing: at 256 workers on 2 loaded cores, such answers (a deadline that passed while
    the coordinator was stopped, after its stall had forgiven the silence) fell through to the
    peer-report path and removed live workers, or re-formed the ring for nothing."""
    w, since = event.worker_id, event.since
    if state.silent_probes.get(w) == since:
        if event.alive or event.timed_out:
            return state
        return replace(state, found_dead={**state.found_dead, w: SILENT_REFUSED if event.refused else SILENT_FAILED})
    if state.sweep.get(w) == since:
        # The swept worker may well heartbeat: only a refusal outweighs that.
        sweep = {k: v for k, v in state.sweep.items() if k != w}
        if not event.refused or w not in state.workers:
            return replace(state, sweep=sweep)
        return replace(state, sweep=sweep, found_dead={**state.found_dead, w: SWEPT})
    return state


# How each death was found, as the Removed reason says it.
PEER_DEAD = "reported by a peer and did not answer a probe"
SILENT_REFUSED = "refused a probe (its process is gone)"
SILENT_FAILED = "failed a probe at once (its address did not resolve, or did not speak gRPC health)"
SWEPT = "refused the probe of the sweep that follows a death (its process is gone)"


def settle_deaths(state: State, now: float) -> tuple[State, list[Action]]:
    """Ends the probes of silent workers that spoke again since theirs began, and removes the
    dead, all in one view. Called on Tick, with the heartbeats folded into last_seen.

    Dead: refused a probe (as silent, in a sweep, or reported by a peer), or silent through the
    grace. Deaths come together (a host, a rack, a job's kill) but are found apart: a peer
    reports one at once, another's silence expires seconds later, one at a time, and each
    removal would be a view that every rank must install. So the first death found opens a
    **sweep**: every worker silent for more than an interval is probed at once (a process that is gone refuses in milliseconds), and the view
    waits, at most ``sweep_s``, for those probes and the silent workers' still under way. All
    found dead by then leave together. Only a refusal finds a swept worker dead: an answer, none
    in time (a stopped worker, judged by its own silence later) or another failure (a name not
    resolved, which says nothing about a worker that heartbeats) decide nothing, and a swept
    worker that heartbeats before the view is published stays. So a death
    costs at most ``sweep_s`` more than its finding: within ``heartbeat_timeout_s +
    silence_grace_s + sweep_s`` and a tick of the last heartbeat (plus up to the failure window
    while others are nearly silent, see expire), or a probe's deadline plus ``sweep_s`` of a
    peer's report."""
    rules = state.rules
    pending = {w: began for w, began in state.silent_probes.items()
               if w in state.workers and state.last_seen.get(w, -INF) <= began}
    grace = rules.silence_grace_s
    dead = {w: why for w, why in state.found_dead.items() if w in state.workers}
    for w, began in pending.items():
        if w not in dead and now - began >= grace:
            dead[w] = f"silent through its grace ({grace:g} s)"
    if len(pending) != len(state.silent_probes) or len(dead) != len(state.found_dead):
        state = replace(state, silent_probes=pending, found_dead=dead)
    if not dead:
        return replace(state, sweep={}, dead_since=INF) if state.dead_since != INF else state, []
    actions: list[Action] = []
    if state.dead_since == INF:
        state = replace(state, dead_since=now)
        if rules.sweep_s > 0:
            state, actions = _open_sweep(state, dead, now)
    undecided = (state.sweep.keys() | pending.keys()) - dead.keys()
    if undecided and now - state.dead_since < rules.sweep_s:
        return state, actions
    # A swept worker heard from since the sweep began lives, whatever its address said (one
    # advertised wrong, a stand-in's in a test): a heartbeat outweighs a refusal.
    dead = {w: why for w, why in dead.items() if why != SWEPT or state.last_seen.get(w, -INF) < state.dead_since}
    deadline = rules.heartbeat_timeout_s
    removed = [Removed(w, f"silent {now - state.last_seen[w]:.1f} s, past the timeout ({deadline:g} s), then {why}"
                       if w in pending else why) for w, why in dead.items()]
    state = remove_all(state, list(dead), now, failed=True)
    return replace(state, sweep={}, found_dead={}, dead_since=INF), actions + removed


def _open_sweep(state: State, dead: dict[str, str], now: float) -> tuple[State, list[Action]]:
    """Probes, at once, the workers that may have died with ``dead``: those silent for more than
    a heartbeat interval (see settle_deaths). Not every worker on a host of theirs: one heard
    within the interval is not suspect, and workers killed together that are not silent yet are
    reported by their peers within the sweep's hold (3 of 6 real workers: within 0.04 s)."""
    quiet = now - heartbeat_interval(state)
    targets = [m for w, m in state.workers.items()
               if w not in dead and w not in state.silent_probes and state.last_seen.get(w, now) < quiet]
    state = replace(state, sweep={m.worker_id: now for m in targets})
    return state, [Probe(m.worker_id, m.address, timeout_s=state.rules.sweep_s, began=now, sweep=True)
                   for m in targets]
