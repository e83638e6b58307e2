"""Elastic ``ringserve run``: workers that come and go, on fixed hosts or on discovered ones.

The coordinator decides the world (who is in which view, admitted at commits); the launcher only
decides which slots have a worker process, as horovodrun's elastic driver does:

- **Discovery.** ``--host-discovery-script`` is run every second (launch.group.Placement). Its
  first run must succeed, or the launch fails at once; later failures are reported and the last
  hosts found are kept (horovodrun's rule). The run starts once ``-np`` slots are found, within
  the elastic timeout, with workers in up to ``--max-np`` slots.
- **Hosts added** get workers in their slots (up to ``--max-np``); the workers join the world at
  its next commit. **Hosts removed** (or slots taken away) have their workers sent SIGTERM: they
  leave at their next commit, and their exit is no failure.
- **Failures.** On this host alone (no hosts given), a failed worker is left out and the others
  go on, or with ``--restart-failed`` it starts again. With hosts, a failure blacklists the
  worker's host (horovodrun's behaviour): its other workers are stopped, and none starts there
  until the cooldown of ``--blacklist-cooldown-range`` ends (for good without one); with
  ``--restart-failed`` the failed worker starts again in place until its host has failed
  HOST_FAILURE_LIMIT times. A worker exiting with 65 (the job's state is lost) ends the run.
- **The end.** When a worker finishes with 0, training is over: no one new starts, and those still
  running get FINISH_GRACE_S to finish before they are stopped. One of them that finds the job's
  state gone (65: the holders finished and left before it joined) ends nothing either. When no
  worker is left and none finished, the run ends with the last failure.

The prefix of a worker's lines is its index: a slot keeps its index across restarts, and slots
that appear later get new ones (after a world change the index is no longer the rank).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from ringserve.errors import STATE_LOST_EXIT_CODE, InvalidArgumentError
from ringserve.launch.group import Outcome, Workers
from ringserve.launch.hosts import Blacklist, HostSpec, assign_slots, host_order, parse_discovery_output, plan_slots
from ringserve.launch.procs import Proc

FINISH_GRACE_S = 30.0
HOST_FAILURE_LIMIT = 3  # with --restart-failed: the failure that blacklists a host
# With --restart-failed: this many workers in a row dying the same way (exit code and last line)
# before any worker joined the job ends the run: a command that cannot start (a python without the
# job's packages) is not restarted until every restart is spent.
SAME_EARLY_DEATHS = 3
POLL_S = 0.05

Key = tuple[str, int]


class Discovery:
    """Runs a host discovery script now and then on a thread of its own; ``latest`` is what it
    last found."""

    def __init__(self, script: str, default_slots: int, interval_s: float, *, timeout_s: float,
                 note: Callable[[str], None]) -> None:
        self.script = script
        self._default_slots = default_slots
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._note = note
        self._latest: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="ringserve-discovery", daemon=True)
        self._failing = False

    def run_once(self) -> dict[str, int] | str:
        """The hosts found, or a sentence saying why the script failed."""
        try:
            done = subprocess.run(self.script, check=False, shell=True, capture_output=True, timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            return f"the host discovery script {self.script!r} did not finish within {self._timeout_s:g} s"
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            said = f": {err[-1]}" if err else ""
            return f"the host discovery script {self.script!r} exited with code {done.returncode}{said}"
        try:
            return parse_discovery_output(done.stdout.decode(errors="replace"), self._default_slots)
        except InvalidArgumentError as exc:
            return str(exc)

    def first(self) -> Outcome | dict[str, int]:
        found = self.run_once()
        if isinstance(found, str):
            return Outcome(1, reason=found)
        with self._lock:
            self._latest = found
        return found

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            found = self.run_once()
            if isinstance(found, str):
                if not self._failing:
                    self._note(f"{found}; keeping the hosts found before, and trying again")
                self._failing = True
                continue
            self._failing = False
            with self._lock:
                self._latest = found

    def latest(self) -> dict[str, int]:
        with self._lock:
            return dict(self._latest)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s + 5.0)


class _Run:
    """The state of one elastic run, between polls."""

    def __init__(self, workers: Workers, *, restarts_left: int, restart_failed: bool,
                 blacklist: Blacklist | None) -> None:
        self.workers = workers
        self.restarts_left = restarts_left
        self.restart_failed = restart_failed
        self.blacklist = blacklist
        self.running: dict[Key, Proc] = {}
        self.leaving: set[Key] = set()
        self.dead: set[Key] = set()  # on this host alone: failed, never filled again
        self.index: dict[Key, int] = {}
        self.host_failures: Counter[str] = Counter()
        self.finished_at: float | None = None
        self.last_failure: Outcome | None = None
        self.early_deaths: list[tuple[int, str]] = []  # (exit code, last line) of those dead before any join

    def reap(self, now: float) -> Outcome | None:
        """Takes note of the workers that ended; an Outcome when the run must end now."""
        for key, proc in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[key]
            name = self.workers.name(proc)
            if key in self.leaving:
                self.leaving.discard(key)
                self.workers.note(f"{name} left (exit code {code})")
                continue
            if code == 0:
                self.finished_at = self.finished_at or now
                continue
            if code == STATE_LOST_EXIT_CODE and self.finished_at is not None:
                # Training is over and its holders have left: one still waiting to join finds the
                # state gone. It took no part, as one stopped at the grace's end (no failure).
                self.workers.note(f"{name} found the job's state gone after training finished (exit code {code}); "
                                  f"not a failure")
                continue
            self.last_failure = Outcome(code, failed_rank=proc.index, host=proc.host, reason=proc.reason())
            if code == STATE_LOST_EXIT_CODE:
                self.workers.note(f"{name} lost the job's committed state (exit code {code}, StateLostError); "
                                  f"restarting nobody and ending the run")
                return self.last_failure
            ended = self._failed(key, proc, code, now)
            if ended is not None:
                return ended
        return None

    def _failed(self, key: Key, proc: Proc, code: int, now: float) -> Outcome | None:
        name = self.workers.name(proc)
        if not self.workers.joined():
            proc.join_pumps(time.monotonic() + 1.0)  # its last line, copied out
            self.early_deaths.append((code, proc.last_line))
            last = self.early_deaths[-SAME_EARLY_DEATHS:]
            if len(last) == SAME_EARLY_DEATHS and len(set(last)) == 1:
                said = f": {proc.last_line}" if proc.last_line else ""
                self.workers.note(f"{SAME_EARLY_DEATHS} workers in a row exited with code {code} before any joined "
                                  f"the job{said}; restarting nobody and ending the run")
                return Outcome(code, failed_rank=proc.index, host=proc.host,
                               reason=f"every worker died the same way before joining (exit code {code}){said}")
        self.host_failures[proc.host] += 1
        may_restart = self.finished_at is None and self.restart_failed and self.restarts_left > 0
        if may_restart and (self.blacklist is None or self.host_failures[proc.host] < HOST_FAILURE_LIMIT):
            self.restarts_left -= 1
            self.workers.note(f"{name} exited with code {code}; starting it again ({self.restarts_left} restarts left)")
            return None  # the plan fills its slot again
        if self.blacklist is None:
            self.dead.add(key)
            self.workers.note(f"{name} exited with code {code}; the others go on")
            return None
        delay = self.blacklist.add(proc.host, now)
        others = [k for k in self.running if k[0] == proc.host and k not in self.leaving]
        until = "for good" if delay is None else f"for {delay:.0f} s"
        self.workers.note(f"{proc.reason()}; host {proc.host} is blacklisted {until}"
                          + (f", and its {len(others)} other worker(s) stopped" if others else "")
                          + "; the others go on")
        for k in others:
            self.running[k].terminate()
            self.leaving.add(k)
        return None

    def apply(self, wanted: list[Key], *, announce: bool) -> None:
        """Stops the workers of slots no longer wanted (SIGTERM) and starts those of new ones."""
        wanted_set = set(wanted)
        leaving: Counter[str] = Counter()
        for key, proc in self.running.items():
            if key not in wanted_set and key not in self.leaving:
                proc.terminate()
                self.leaving.add(key)
                leaving[key[0]] += 1
        for host, n in leaving.items():
            self.workers.note(f"host {host} lost {n} slot(s); stopping {n} worker(s) there "
                              f"(SIGTERM: they leave at their next commit)")
        if not wanted:
            return
        counts: dict[str, int] = {}
        for host, _ in wanted:
            counts[host] = counts.get(host, 0) + 1
        slots = assign_slots([HostSpec(h, n) for h, n in counts.items()], len(wanted))
        joining: Counter[str] = Counter()
        # Remote workers first: local ones advertise the address the remote hosts see this one by.
        placed = sorted(zip(wanted, slots, strict=True), key=lambda ks: self.workers.is_local(ks[0][0]))
        for key, slot in placed:
            if key in self.running or key in self.dead:
                continue
            if key not in self.index:
                self.index[key] = len(self.index)
            new = self.workers.start(self.index[key], key[1], slot)
            if new is not None:
                self.running[key] = new
                joining[key[0]] += 1
        if announce:
            for host, n in joining.items():
                self.workers.note(f"starting {n} worker(s) on {host}; they join at the next commit")


def _excluder(blacklist: Blacklist | None, now: float) -> Callable[[str], bool]:
    return lambda host: blacklist is not None and blacklist.is_blacklisted(host, now)


def supervise(workers: Workers, *, num_proc: int, max_np: int, hosts: Sequence[HostSpec] | None,
              discovery: Discovery | None, restart_failed: bool, max_restarts: int,
              blacklist: Blacklist | None, elastic_timeout_s: float,
              clock: Callable[[], float] = time.monotonic, fatal: Callable[[], str] = lambda: "") -> Outcome:
    """Keeps workers in the slots an elastic run should have until training ends (see the module
    docstring). Either ``hosts`` (fixed) or ``discovery`` gives the hosts. ``fatal()``, when it
    says why, ends the run with exit code 1 (a parameter-server shard down for good)."""
    run = _Run(workers, restarts_left=max_restarts, restart_failed=restart_failed, blacklist=blacklist)
    order: list[str] = []
    began = clock()
    started = False
    while True:
        now = clock()
        found = discovery.latest() if discovery is not None else {h.name: h.slots for h in hosts or ()}
        order = host_order(order, found)
        ended = run.reap(now)
        if ended is not None:
            return ended
        if why := fatal():
            return Outcome(1, reason=why)
        if run.finished_at is not None:
            if not run.running:
                return Outcome(0)
            if now - run.finished_at > FINISH_GRACE_S:
                workers.note(f"training finished; stopping {len(run.running)} worker(s) still waiting to join")
                return Outcome(0)
            time.sleep(POLL_S)
            continue

        wanted = plan_slots(order, found, max_np, _excluder(blacklist, now))
        if not started and len(wanted) < num_proc:
            if now - began > elastic_timeout_s:
                return Outcome(1, reason=f"waited {elastic_timeout_s:g} s for {num_proc} slots (-np); "
                                         f"the hosts offer {len(wanted)}: {found or 'none'}")
            time.sleep(POLL_S)
            continue
        run.apply([k for k in wanted if k not in run.dead], announce=started)
        started = started or bool(run.running)
        if started and not run.running and not any(k not in run.dead for k in wanted):
            return run.last_failure or Outcome(1, reason="no worker is left and none can start")
        time.sleep(POLL_S)
