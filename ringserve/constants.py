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

# -- the worker's node -----------------------------------------------------------------------

# The peer server's grace at close(): collectives were drained already (drain_timeout_s), so what
# is left are streams the peers are closing too; half a second lets their last frames go.
SERVER_STOP_GRACE_S = 0.5
