"""``ringserve run -np N command...``: a coordinator and N workers, on this host or on several, like
horovodrun.

The coordinator runs inside the launcher on a background loop. Each worker gets
RINGSERVE_COORDINATOR and RINGSERVE_RANK_HINT (its process index, which becomes its rank in the
first view), and Horovod's and torchrun's variables (see launch.env). Output lines are prefixed with the rank. When one worker
fails, the others are stopped (SIGTERM, then SIGKILL after a grace) and the launcher exits with
that worker's code.

With hosts (``-H host1:4,host2:4``, ``--hostfile``) the coordinator still runs here, on the
launching host; workers on other hosts start over ssh (launch.procs, launch.remote) and those on
this host without it. The failure of any host (ssh cannot reach it, the connection is lost, a
worker there exits non-zero) stops the run with a sentence naming the host and the rank, and the
failure's exit code (ssh's 255 for ssh's own failures). See launch.group for what a run over
several hosts sets up, and launch.elastic for elastic runs and host discovery.

A worker that exits with STATE_LOST_EXIT_CODE (65: an uncaught StateLostError, see
ringserve.elastic.run) lost the job's committed state. Elastic or not, with --restart-failed or
not, nobody is restarted (a fresh process holds even less): the others are stopped and the
launcher exits with 65.
"""

from typing import TYPE_CHECKING

from ringserve._lazy import exports

if TYPE_CHECKING:  # the same names, for type checkers (ringserve._lazy)
    from ringserve.launch.group import Outcome, Placement
    from ringserve.launch.run import launch

__all__ = ["Outcome", "Placement", "launch"]

__getattr__, __dir__ = exports(__name__, {"Outcome": "ringserve.launch.group", "Placement": "ringserve.launch.group",
                                          "launch": "ringserve.launch.run"})
