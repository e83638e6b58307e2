"""The environment ``ringserve run`` gives each worker besides ringserve's own: Horovod's and torch's.

Scripts written for Horovod read ``HOROVOD_RANK`` and friends (to pick a GPU, to name a log
file, to skip work on all but rank 0) before or without calling ``hvd.init()``; ``horovodrun``
exports them, and so does ``ringserve run``. They describe the launch as it was started, from
the launcher's own numbering of its processes (its slots):

- ``HOROVOD_RANK``: the slot, which is the worker's rank in the first view (RINGSERVE_RANK_HINT);
- ``HOROVOD_SIZE``: the number of processes started (``-np``);
- ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``: the same, since every process runs on this host;
- ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``: 0 and 1 (one host);
- ``HOROVOD_HOSTNAME``: this host's name.

A variable cannot follow a process's rank once it runs: in elastic mode ranks change with the
world (and a restarted slot may come back with another rank), so there, as in Horovod's elastic
mode, ``hvd.rank()`` and ``hvd.size()`` are the live values and these only the starting ones.
Horovod's Gloo settings (``HOROVOD_GLOO_*``, ``HOROVOD_CONTROLLER``) are not set: nothing
here reads them.

torch's variables, as torchrun exports them, so that a torch.distributed script's
``init_process_group("ringserve")`` (``env://``, its default) works unchanged:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (0), ``ROLE_RANK``,
  ``ROLE_WORLD_SIZE``: the slot and ``-np``, as for Horovod's;
- ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``: where rank 0 serves torch's own store (a port
  the launcher found free). ringserve itself does not use them: every worker joins the launcher's
  coordinator (RINGSERVE_COORDINATOR).
"""

from __future__ import annotations

import socket


def horovod_env(slot: int, num_proc: int, hostname: str | None = None) -> dict[str, str]:
    """Horovod's variables for the worker started in ``slot`` of ``num_proc`` on one host."""
    return {
        "HOROVOD_HOSTNAME": hostname if hostname is not None else socket.gethostname(),
        "HOROVOD_RANK": str(slot),
        "HOROVOD_SIZE": str(num_proc),
        "HOROVOD_LOCAL_RANK": str(slot),
        "HOROVOD_LOCAL_SIZE": str(num_proc),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
    }


def torch_env(slot: int, num_proc: int, master_port: int) -> dict[str, str]:
    """torchrun's variables for the worker started in ``slot`` of ``num_proc`` on one host."""
    return {
        "RANK": str(slot),
        "WORLD_SIZE": str(num_proc),
        "LOCAL_RANK": str(slot),
        "LOCAL_WORLD_SIZE": str(num_proc),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(slot),
        "ROLE_WORLD_SIZE": str(num_proc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (torch's store binds it a moment later, as torchrun's does)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
