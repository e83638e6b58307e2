"""Configs are frozen, keyword-only, validated on construction, and read the environment only in from_env."""

from __future__ import annotations

import dataclasses

import pytest

from ringserve.config import CoordinatorConfig, WorkerConfig
from ringserve.errors import InvalidArgumentError


def test_the_defaults_are_valid() -> None:
    assert CoordinatorConfig().port == 0
    assert WorkerConfig().coordinator == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_workers": 0}, r"CoordinatorConfig.min_workers \(0\) must be greater than zero."),
        ({"max_workers": -1}, r"CoordinatorConfig.max_workers \(-1\) must be greater than zero."),
        ({"tick_s": 0.0}, r"CoordinatorConfig.tick_s \(0.0\) must be greater than zero."),
        ({"heartbeat_interval_s": 0}, r"CoordinatorConfig.heartbeat_interval_s \(0\) must be greater than zero."),
        ({"max_message_bytes": 0}, r"CoordinatorConfig.max_message_bytes \(0\) must be greater than zero."),
        ({"settle_s": -0.5}, r"The settle window \(-0.5\) must not be negative."),
        (
            {"min_workers": 4, "max_workers": 3},
            r"The maximum number of workers \(3\) must be at least the minimum \(4\).",
        ),
        (
            {"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 2.0},
            r"The heartbeat timeout \(2.0 s\) must be longer than the heartbeat interval \(2.0 s\).",
        ),
    ],
)
def test_an_invalid_coordinator_config_is_rejected_with_a_sentence_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        CoordinatorConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_bytes": 0}, r"WorkerConfig.chunk_bytes \(0\) must be greater than zero."),
        ({"connect_timeout_s": -1.0}, r"WorkerConfig.connect_timeout_s \(-1.0\) must be greater than zero."),
        ({"rendezvous_timeout_s": 0}, r"WorkerConfig.rendezvous_timeout_s \(0\) must be greater than zero."),
        ({"collective_timeout_s": 0}, r"WorkerConfig.collective_timeout_s \(0\) must be greater than zero."),
        ({"rpc_timeout_s": 0}, r"WorkerConfig.rpc_timeout_s \(0\) must be greater than zero."),
        ({"abort_grace_s": 0}, r"WorkerConfig.abort_grace_s \(0\) must be greater than zero."),
        ({"coordinator": "localhost"}, r"The coordinator address \('localhost'\) must have the form host:port."),
    ],
)
def test_an_invalid_worker_config_is_rejected_with_a_sentence_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        WorkerConfig(**kwargs)


def test_configs_are_frozen_and_keyword_only() -> None:
    config = WorkerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunk_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        CoordinatorConfig("0.0.0.0")  # type: ignore[misc]
    with pytest.raises(TypeError):
        WorkerConfig("127.0.0.1:1")  # type: ignore[misc]


def test_worker_from_env_reads_ringserve_variables_by_type() -> None:
    env = {
        "RINGSERVE_COORDINATOR": "coord:7000",
        "RINGSERVE_CHUNK_BYTES": "4096",
        "RINGSERVE_CONNECT_TIMEOUT_S": "2.5",
        "RINGSERVE_USE_UVLOOP": "0",
        "RINGSERVE_RANK_HINT": "3",
        "RINGSERVE_HOSTNAME": "",  # empty means unset
        "UNRELATED": "x",
    }
    config = WorkerConfig.from_env(env)
    assert config.coordinator == "coord:7000"
    assert config.chunk_bytes == 4096
    assert config.connect_timeout_s == 2.5
    assert config.use_uvloop is False
    assert config.rank_hint == 3
    assert config.hostname == WorkerConfig().hostname


@pytest.mark.parametrize("raw", ["1", "true", "YES", "on"])
def test_boolean_variables_accept_the_usual_spellings_of_true(raw: str) -> None:
    assert WorkerConfig.from_env({"RINGSERVE_USE_UVLOOP": raw}).use_uvloop is True


def test_explicit_overrides_win_over_the_environment_and_none_overrides_are_ignored() -> None:
    env = {"RINGSERVE_COORDINATOR": "env:1", "RINGSERVE_CHUNK_BYTES": "100"}
    config = WorkerConfig.from_env(env, coordinator="arg:2", chunk_bytes=None)
    assert config.coordinator == "arg:2"
    assert config.chunk_bytes == 100


def test_coordinator_from_env_reads_its_own_variables() -> None:
    config = CoordinatorConfig.from_env({"RINGSERVE_MIN_WORKERS": "4", "RINGSERVE_SETTLE_S": "0.25"}, port=123)
    assert (config.min_workers, config.settle_s, config.port) == (4, 0.25, 123)


def test_a_malformed_variable_is_rejected_naming_the_variable_and_its_value() -> None:
    with pytest.raises(InvalidArgumentError, match=r"RINGSERVE_CHUNK_BYTES \('big'\) is not a valid int."):
        WorkerConfig.from_env({"RINGSERVE_CHUNK_BYTES": "big"})
    with pytest.raises(InvalidArgumentError, match=r"RINGSERVE_SETTLE_S \('soon'\) is not a valid float."):
        CoordinatorConfig.from_env({"RINGSERVE_SETTLE_S": "soon"})


def test_values_from_the_environment_are_validated_like_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match=r"must be at least the minimum"):
        CoordinatorConfig.from_env({"RINGSERVE_MIN_WORKERS": "5", "RINGSERVE_MAX_WORKERS": "2"})


def test_from_env_reads_os_environ_only_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_COORDINATOR", "from-os:9")
    assert WorkerConfig.from_env().coordinator == "from-os:9"
    assert WorkerConfig().coordinator == "127.0.0.1:50051"


def test_the_data_plane_accepts_frames_a_little_larger_than_a_chunk() -> None:
    config = WorkerConfig(chunk_bytes=1000)
    assert config.max_message_bytes > 1000


@pytest.mark.parametrize("slots", [0, 4033, 5000])
def test_shared_slots_outside_their_range_are_rejected_naming_the_value_and_the_variable(slots: int) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"shared_slots \({slots}\) must be in \[1, 4032\] \(RINGSERVE_SHARED_SLOTS\)"):
        WorkerConfig.from_env({"RINGSERVE_SHARED_SLOTS": str(slots)})


def test_the_shared_slots_limit_matches_the_shared_ring_layout() -> None:
    from ringserve.config import MAX_SHARED_SLOTS
    from ringserve.worker.dataplane.links import shared
    shared.OutboundRing(MAX_SHARED_SLOTS, 1).close()
    with pytest.raises(ValueError):
        shared.OutboundRing(MAX_SHARED_SLOTS + 1, 1)


def test_a_timeline_under_a_file_or_with_stray_braces_is_rejected_and_a_missing_directory_is_accepted(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidArgumentError, match=r"timeline .* cannot be written: .*a-file' is not a directory"):
        WorkerConfig.from_env({"RINGSERVE_TIMELINE": str(blocker / "trace-{rank}.json")})
    with pytest.raises(InvalidArgumentError, match=r"may hold only \{rank\} in braces"):
        WorkerConfig(timeline=str(tmp_path / "trace-{rank}-{host}.json"))
    assert WorkerConfig(timeline=str(tmp_path / "not" / "yet" / "trace")).timeline.endswith("trace")
    assert not (tmp_path / "not").exists()  # made only when the first view is installed


def test_the_peer_servers_grpc_cap_leaves_room_for_every_unverified_stream_besides_the_ring() -> None:
    config = WorkerConfig(max_unverified_streams=5, max_concurrent_rpcs=7)
    assert config.server_rpc_cap == 12
    with pytest.raises(InvalidArgumentError, match=r"peer_hello_timeout_s \(0\) must be greater than zero"):
        WorkerConfig(peer_hello_timeout_s=0)


def test_torchs_rank_is_the_rank_hint_unless_ringserve_names_one() -> None:
    assert WorkerConfig.from_env({"RANK": "2"}).rank_hint == 2
    assert WorkerConfig.from_env({"RANK": "2", "RINGSERVE_RANK_HINT": "0"}).rank_hint == 0
    assert WorkerConfig.from_env({"RANK": "2"}, rank_hint=1).rank_hint == 1
    assert WorkerConfig.from_env({}).rank_hint == -1
    assert WorkerConfig.from_env({"RANK": "not-a-rank"}).rank_hint == -1


def test_the_wait_for_a_lost_commits_holders_is_bounded_by_half_the_collective_timeout() -> None:
    assert WorkerConfig().holder_wait_bound_s == 30.0
    assert WorkerConfig(holder_wait_s=100.0, collective_timeout_s=60.0).holder_wait_bound_s == 30.0
    assert WorkerConfig.from_env({"RINGSERVE_HOLDER_WAIT_S": "0"}).holder_wait_bound_s == 0.0
    with pytest.raises(InvalidArgumentError, match=r"holder_wait_s \(-1\.0\) must be at least 0 \(RINGSERVE_HOLDER_WAIT_S\)"):
        WorkerConfig(holder_wait_s=-1.0)


def test_a_negative_result_pool_is_rejected_and_the_variable_sets_it() -> None:
    with pytest.raises(InvalidArgumentError, match=r"result_pool_bytes \(-1\) must be at least 0 \(RINGSERVE_RESULT_POOL_BYTES\)"):
        WorkerConfig(result_pool_bytes=-1)
    assert WorkerConfig.from_env({"RINGSERVE_RESULT_POOL_BYTES": "0"}).result_pool_bytes == 0


def test_a_timeline_where_no_directory_can_be_made_fails_at_startup_naming_ringserve_timeline(tmp_path) -> None:
    # /proc takes no new directory, whatever its mode bits tell root: tried, not guessed.
    with pytest.raises(InvalidArgumentError, match=r"\(.*RINGSERVE_TIMELINE\) cannot be written: no directory can be "
                                                   r"made in '/proc'"):
        WorkerConfig.from_env({"RINGSERVE_TIMELINE": "/proc/ringserve-no/trace"})
    WorkerConfig(timeline=str(tmp_path / "trace"))
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
