"""Secure by default (ringserve.config.secured_job, docs/deploy/security.md): a coordinator that
other hosts can reach gets a token made for the job unless the user gave one (or client
certificates), or opted out by name; every launcher takes that one path.

The launchers' tests run a whole job inside a network namespace the test makes, whose one
interface has an address off loopback, so the coordinator binds 0.0.0.0 there (never on this
machine's network). In each, a call without the token is refused with UNAUTHENTICATED, and the
job's own workers, which the launcher gave the token, finish their allreduce.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ringserve.cli import standalone_config
from ringserve.config import INSECURE_ENV, CoordinatorConfig, insecure_opted, is_loopback, secured_job
from ringserve.errors import UsageError

HERE = Path(__file__).resolve().parent
JOBS = HERE / "secure_jobs.py"
ROOT = HERE.parent.parent
HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None
needs_netns = pytest.mark.skipif(not HAVE_NETNS, reason="needs root and iproute2 to make the test's own network namespace")


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("[::1]", True),
                                                ("0.0.0.0", False), ("10.0.0.5", False), ("node-3", False)])
def test_loopback_is_told_by_address_or_the_name_localhost(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_coordinator_on_loopback_keeps_its_settings() -> None:
    config = CoordinatorConfig(host="127.0.0.1")
    assert secured_job(config, insecure=False) is config


def test_off_loopback_a_job_gets_a_token_of_its_own_each_time() -> None:
    config = CoordinatorConfig(host="0.0.0.0")
    one, two = secured_job(config, insecure=False), secured_job(config, insecure=False)
    assert len(one.token) >= 32 and one.token != two.token
    assert replace(one, token="") == config  # nothing else changes
    assert one.token not in repr(one)


@pytest.mark.parametrize("given", [{"token": "the-users"}, {"token_file": "/run/secrets/job.token"},
                                   {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem",
                                    "tls_require_client_auth": True}])
def test_the_users_token_token_file_or_client_certificates_are_kept(given: dict[str, object]) -> None:
    config = CoordinatorConfig(host="0.0.0.0", **given)  # type: ignore[arg-type]
    assert secured_job(config, insecure=False) is config


def test_tls_without_client_certificates_still_gets_a_token() -> None:
    config = CoordinatorConfig(host="0.0.0.0", tls_cert="c.pem", tls_key="k.pem")
    assert secured_job(config, insecure=False).token


def test_opting_out_is_by_name_only_and_logged(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    config = CoordinatorConfig(host="0.0.0.0")
    assert secured_job(config, insecure=True) is config
    monkeypatch.setenv(INSECURE_ENV, "1")
    assert insecure_opted()
    with caplog.at_level("WARNING", logger="ringserve"):
        assert secured_job(config) is config
    assert INSECURE_ENV in caplog.text and "takes any worker" in caplog.text
    for word in ("0", "no", "", "insecure"):
        monkeypatch.setenv(INSECURE_ENV, word)
        assert secured_job(config).token, word


# -- a coordinator started by hand -------------------------------------------------------------------


def test_a_coordinator_started_by_hand_off_loopback_without_a_credential_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    proc = subprocess.run([sys.executable, "-m", "ringserve.cli", "coordinator", "--host", "0.0.0.0"],
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "would take any worker" in proc.stderr, proc.stderr
    for way in ("RINGSERVE_TOKEN", "--make-token", "--tls-require-client-auth", INSECURE_ENV):
        assert way in proc.stderr
    assert "listening" not in proc.stdout  # it never bound


def test_make_token_makes_an_owner_only_token_once_and_keeps_it_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "token"
    config = standalone_config(CoordinatorConfig(host="0.0.0.0"), str(path))
    assert config.token_file == str(path) and not config.token
    first = path.read_text().strip()
    assert len(first) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*tmp"))  # written whole, no temporary left
    standalone_config(CoordinatorConfig(host="0.0.0.0"), str(path))
    assert path.read_text().strip() == first  # a restarted coordinator keeps its job's token
    with pytest.raises(UsageError, match="not both"):
        standalone_config(CoordinatorConfig(host="0.0.0.0", token="t"), str(path))


def test_a_coordinator_by_hand_on_loopback_or_with_a_credential_starts_as_given() -> None:
    for config in (CoordinatorConfig(), CoordinatorConfig(host="0.0.0.0", token="t"),
                   CoordinatorConfig(host="0.0.0.0", token_file="/run/secrets/t")):
        assert standalone_config(config, "") is config


# -- every launcher, off loopback, in a namespace of the test's own ---------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def off_loopback() -> Iterator[tuple[str, str]]:
    """A network namespace with lo and an interface at an address off loopback: (name, address)."""
    ns = f"rs-sec-{uuid.uuid4().hex[:8]}"
    address = f"10.89.{random.randrange(1, 250)}.1"
    ip("netns", "add", ns)
    try:
        ip("-n", ns, "link", "set", "lo", "up")
        # A veth pair with both ends inside (this kernel has no dummy device): one carries the address.
        ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth1", "up")
        ip("-n", ns, "link", "set", "eth0", "up")
        yield ns, address
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def run_in(ns: str, argv: list[str], env: dict[str, str], timeout_s: float) -> list[dict[str, object]]:
    """Runs ``argv`` in ``ns``; returns what its workers reported (secure_jobs.report)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "HOROVOD_"))}
    proc = subprocess.run(["ip", "netns", "exec", ns, *argv], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    # Ranks print at once: two reports may share a line.
    results = [json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return results


def assert_secure(results: list[dict[str, object]], n: int) -> None:
    assert len(results) == n, results
    assert {r["outsider"] for r in results} == {"refused: UNAUTHENTICATED"}, results
    assert {r["sum"] for r in results} == {n * (n + 1) / 2}, results


@needs_netns
@pytest.mark.timeout(180)
def test_ringserve_run_across_hosts_makes_a_token_and_refuses_a_worker_without_it(tmp_path: Path) -> None:
    with off_loopback() as (ns, address):
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\necho {address}:2\n")
        discover.chmod(0o755)
        argv = [sys.executable, "-m", "ringserve.cli", "run", "-np", "2", "--min-np", "2",
                "--host-discovery-script", str(discover), "--advertise-host", address,
                sys.executable, str(JOBS), "worker"]
        results = run_in(ns, argv, {}, 150)
    assert_secure(results, 2)
    assert all(r["token_in_env"] for r in results)


@needs_netns
@pytest.mark.timeout(180)
def test_ringserve_run_with_the_opt_out_by_name_runs_open() -> None:
    with off_loopback() as (ns, address):
        argv = [sys.executable, "-m", "ringserve.cli", "run", "-np", "2", "-H", f"{address}:2",
                sys.executable, str(JOBS), "worker"]
        results = run_in(ns, argv, {INSECURE_ENV: "1"}, 150)
    assert {r["outsider"] for r in results} == {"answered"} and len(results) == 2


@needs_netns
@pytest.mark.timeout(240)
def test_torchrun_off_loopback_publishes_a_token_in_the_store_and_refuses_a_rank_without_it() -> None:
    with off_loopback() as (ns, address):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", address, "--master-port", str(random.randrange(20000, 30000)),
                str(JOBS), "torch"]
        results = run_in(ns, argv, {}, 200)
    assert_secure(results, 2)


@needs_netns
@pytest.mark.timeout(300)
def test_spark_on_a_driver_off_loopback_makes_a_token_and_refuses_a_task_without_it() -> None:
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("pyspark needs Java")
    with off_loopback() as (ns, address):
        results = run_in(ns, [sys.executable, str(JOBS), "spark", address, "2"], {"PYSPARK_PYTHON": sys.executable}, 280)
    assert_secure(results, 2)
    assert all(r["token_in_env"] for r in results)


@needs_netns
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_on_a_node_off_loopback_makes_a_token_and_refuses_an_actor_without_it() -> None:
    pytest.importorskip("ray")
    with off_loopback() as (ns, address):
        results = run_in(ns, [sys.executable, str(JOBS), "ray", address, "2"], {"RAY_USAGE_STATS_ENABLED": "0"}, 280)
    assert_secure(results, 2)
    assert all(r["token_in_env"] for r in results)
