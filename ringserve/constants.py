"""Deadlines, slacks and backoffs that are not settings: one home for each, with its reason.

What a user may tune lives in the config objects (ringserve.config); what follows from the design
lives here, so that a value written in two places cannot drift. Pure: imports nothing.
"""

from __future__ import annotations

# -- the worker's control loops --------------------------------------------------------------

# A broken view watch is watched again after this, doubling each time up to the maximum: soon
# enough after a coordinator restart, and no faster than a reconnect a second once it stays away.
WATCH_BACKOFF_FIRST_S = 0.05
WATCH_BACKOFF_MAX_S = 1.0
# While the coordinator stays away, a loop's failures are logged at most once this often (the first
# at once, then a count): a heartbeat fails at every commit, and a line each time floods the log
# (and blocked a worker whose stderr was a pipe nobody read, once the pipe's 64 KiB were full).
OUTAGE_LOG_EVERY_S = 5.0

# -- the worker's node -----------------------------------------------------------------------

# The peer server's grace at close(): collectives were drained already (drain_timeout_s), so what
# is left are streams the peers are closing too; half a second lets their last frames go.
SERVER_STOP_GRACE_S = 0.5

# -- event loops on threads (ringserve.loop) ------------------------------------------------

# gRPC's completion events reach an event loop through whichever loop of the process reads its
# poller: an event of a call made on another loop is handed to that loop (call_soon_threadsafe).
# Calls cancelled by a close complete a moment later, so a loop closed at once after its channels
# and servers would have their last events handed to a closed loop, by another loop of the process
# (a torchrun rank 0 runs its coordinator on a loop of its own beside its worker's): "Event loop is
# closed" in that loop's log. A stopping loop runs this long more, for those events.
GRPC_DRAIN_S = 0.05

# -- waiting from another thread -------------------------------------------------------------

# A thread that waits for a call on the worker's loop gives up this long after the call's own
# deadline: the call fails first, by its own deadline and with its own error; the slack only
# covers the loop's delay in reporting it, and is the backstop should the loop be stuck.
THREAD_WAIT_SLACK_S = 10.0
# The same for a torch.distributed Work: a group's ops run on the loop one after another, so a
# Work's wait also covers the ops queued ahead of it (DDP starts a bucket's allreduce as soon as
# its gradients are in); three times the thread's slack keeps a long queue from timing out first.
WORK_WAIT_SLACK_S = 30.0

# -- elastic training ------------------------------------------------------------------------

# How long survivors wait for a new world (and the launcher for its -np slots): Horovod's default
# (HOROVOD_ELASTIC_TIMEOUT), so that scripts and schedulers tuned for it behave alike.
ELASTIC_TIMEOUT_S = 600.0
# How long a remote worker may take to start over ssh: Horovod's default (HOROVOD_START_TIMEOUT).
REMOTE_START_TIMEOUT_S = 30.0

# -- an embedded coordinator (ringserve run, torchrun's rank 0) --------------------------------

# A job of a fixed size waits only this long after the last join before forming the first view:
# every worker it waits for is already there, and a longer settle only delays the start.
FIXED_JOB_SETTLE_S = 0.2
# Binding a port and starting a gRPC server takes well under a second; this is for a loaded host.
COORDINATOR_START_S = 30.0
# By the time an embedded coordinator stops, its workers have left: the grace only lets the last
# answers go out, and the wait for the stop bounds a server that does not go.
COORDINATOR_STOP_GRACE_S = 0.2
COORDINATOR_STOP_WAIT_S = 10.0
# How often the launcher looks at its workers' exit codes (a failure ends the run within it), and
# rank 0's coordinator at whether the other workers have left.
POLL_S = 0.05

# -- the coordinator -------------------------------------------------------------------------

# The longest the coordinator waits for a suspect's health answer (at most half a heartbeat
# timeout): a dead process refuses the probe at once, so the wait only matters for a stopped or
# cut off one, which heartbeats catch anyway; much shorter, and a loaded machine's live worker
# would fail its probe and be dropped for nothing.
PROBE_TIMEOUT_MAX_S = 2.5
# Once a death is found, how long the view without it waits for the sweep's probes of the workers
# that may have died with it (silence.settle_deaths): a process that is gone refuses in
# milliseconds (24 killed workers' probes all came back within 10 ms at load 15 on 2 cores), so
# this only bounds the wait on a stopped one, whose probe decides nothing; and it adds at most
# this much to the detection of every death.
SWEEP_S = 0.5
