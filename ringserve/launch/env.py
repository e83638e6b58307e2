"""The environment ``ringserve run`` gives each worker besides ringserve's own: Horovod's and torch's.

Scripts written for Horovod read ``HOROVOD_RANK`` and friends (to pick a GPU, to name a log
file, to skip work on all but rank 0) before or without calling ``hvd.init()``; ``horovodrun``
exports them, and so does ``ringserve run``. They describe the launch as it was started, from
the launcher's own numbering of its processes (its slots):

- ``HOROVOD_RANK``: the slot, which is the worker's rank in the first view (RINGSERVE_RANK_HINT);
- ``HOROVOD_SIZE``: the number of processes started (``-np``);
- ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``: the slot's index among its host's, and their
  number (on one host: the same as rank and size);
- ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``: the host's index among the hosts that have a
  slot of this local rank, and their number (0 and 1 on one host);
- ``HOROVOD_HOSTNAME``: the host's name as given to ``-H``, the hostfile or the discovery script
  (this host's name without them).

Over several hosts the slots are numbered as horovodrun numbers them (see launch.hosts).

A variable cannot follow a process's rank once it runs: in elastic mode ranks change with the
world (and a restarted slot may come back with another rank), so there, as in Horovod's elastic
mode, ``hvd.rank()`` and ``hvd.size()`` are the live values and these only the starting ones.
Horovod's Gloo settings (``HOROVOD_GLOO_*``, ``HOROVOD_CONTROLLER``) are not set: nothing
here reads them.

torch's variables, as torchrun exports them, so that a torch.distributed script's
``init_process_group("ringserve")`` (``env://``, its default) works unchanged:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the host's index),
  ``ROLE_RANK``, ``ROLE_WORLD_SIZE``: from the slot, as for Horovod's;
- ``MASTER_ADDR`` and ``MASTER_PORT``: where rank 0 serves torch's own store: 127.0.0.1 and a port
  the launcher found free on one host; over several hosts, the first slot's host (the launching
  host's address if that host is this one) and a port found free here, which must be free there
  too. ringserve itself does not use them: every worker joins the launcher's coordinator
  (RINGSERVE_COORDINATOR).
"""

from __future__ import annotations

import socket

from ringserve.launch.hosts import Slot


def slot_env(slot: Slot) -> dict[str, str]:
    """Horovod's variables for the worker started in ``slot``."""
    return {
        "HOROVOD_HOSTNAME": slot.host,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def horovod_env(slot: int, num_proc: int, hostname: str | None = None) -> dict[str, str]:
    """Horovod's variables for the worker started in ``slot`` of ``num_proc`` on one host."""
    host = hostname if hostname is not None else socket.gethostname()
    return slot_env(Slot(host=host, rank=slot, local_rank=slot, local_size=num_proc, cross_rank=0,
                         cross_size=1, size=num_proc))


def torch_env(slot: Slot, master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for the worker started in ``slot``."""
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.cross_rank),
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(slot.size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (torch's store binds it a moment later, as torchrun's does)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
