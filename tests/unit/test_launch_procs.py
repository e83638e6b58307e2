"""What a remote worker is given and how ssh is called: the launcher's pure choices."""

from __future__ import annotations

import io
import os
import socket
import sys
import threading

from ringserve.launch.procs import SshSettings, describe_exit, forwarded_env, is_local_host, pump


def test_the_environment_is_forwarded_except_the_login_sessions_own_and_what_each_worker_gets() -> None:
    env = {
        "PATH": "/opt/venv/bin:/usr/bin", "PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "RINGSERVE_TOKEN": "t",
        "RINGSERVE_CHUNK_BYTES": "1048576", "HOROVOD_FUSION_THRESHOLD": "1", "LANG": "C.UTF-8",
        "HOME": "/root", "USER": "root", "SHELL": "/bin/bash", "PWD": "/x", "OLDPWD": "/y", "SHLVL": "2",
        "SSH_AUTH_SOCK": "/tmp/a", "SSH_CONNECTION": "1 2 3 4", "BASH_FUNC_f%%": "() { :; }",
        "CUDA_VISIBLE_DEVICES": "0,1", "DISPLAY": ":0", "RINGSERVE_COORDINATOR": "127.0.0.1:1",
        "RINGSERVE_RANK_HINT": "0", "RINGSERVE_BIND_HOST": "127.0.0.1", "HOROVOD_RANK": "0",
    }
    assert forwarded_env(env) == {
        "PATH": "/opt/venv/bin:/usr/bin", "PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "RINGSERVE_TOKEN": "t",
        "RINGSERVE_CHUNK_BYTES": "1048576", "HOROVOD_FUSION_THRESHOLD": "1", "LANG": "C.UTF-8",
    }


def test_ssh_never_prompts_never_allocates_a_terminal_and_gives_up_at_the_start_timeout() -> None:
    argv = SshSettings(port=2222, identity_file="/k", config_file="/c", start_timeout_s=7.5).argv("node-1")
    assert argv[:4] == ["ssh", "-T", "-x", "-a"]
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert options == ["BatchMode=yes", "StrictHostKeyChecking=accept-new", "LogLevel=ERROR", "ConnectTimeout=8",
                       "ServerAliveInterval=5", "ServerAliveCountMax=3"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k" and argv[argv.index("-F") + 1] == "/c"
    assert argv[-2] == "node-1"
    assert argv[-1].startswith(f"PY={sys.executable}; [ -x \"$PY\" ] || PY=python3; exec \"$PY\" -c ")
    assert "-p" not in SshSettings().argv("n")


def test_this_host_is_local_by_any_of_its_names_and_another_login_never_is() -> None:
    for name in ("localhost", "127.0.0.1", "127.0.1.1", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("someone@localhost")
    assert not is_local_host("no-such-host.invalid")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never an address of this machine


def test_an_exit_by_signal_is_named() -> None:
    assert describe_exit("rank 3 on b", 137) == "rank 3 on b was killed by SIGKILL (exit code 137)"
    assert describe_exit("rank 1", 7) == "rank 1 exited with code 7"
    assert describe_exit("rank 1", 255) == "rank 1 exited with code 255"


def test_a_progress_bar_s_redraws_get_one_rank_prefix_each_and_no_empty_line_of_their_own() -> None:
    read_end, write_end = os.pipe()
    # tqdm's output: each redraw starts with a carriage return, and the last one ends the line.
    os.write(write_end, b"\rdigits on 4 workers:   0%|")
    os.write(write_end, b"\rdigits on 4 workers:  50%|")
    os.write(write_end, b"\rdigits on 4 workers: 100%|\nfinal: done\n\nbye")
    os.close(write_end)
    out = io.BytesIO()
    with os.fdopen(read_end, "rb") as stream:
        pump(stream, b"[0] ", out, threading.Lock())
    assert out.getvalue() == (b"[0] digits on 4 workers:   0%|\r[0] digits on 4 workers:  50%|\r"
                              b"[0] digits on 4 workers: 100%|\n[0] final: done\n[0] \n[0] bye\n")
