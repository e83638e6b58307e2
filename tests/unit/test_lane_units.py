"""The payload lane's pure parts: its settings, the launcher's ports for a host's workers, byte
views of payloads, and the receive buffers' reuse."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError
from ringserve.launch.group import payload_ports
from ringserve.worker.dataplane.lanein import POOLED_MIN, LaneBuffers
from ringserve.worker.dataplane.lanes import split_host
from ringserve.worker.dataplane.tcplane import as_bytes


def test_the_lane_is_on_by_default_with_any_free_port_and_a_one_second_connect_deadline() -> None:
    config = WorkerConfig()
    assert (config.payload_lane, config.payload_port, config.payload_advertise_port) == ("auto", 0, 0)
    assert config.payload_connect_timeout_s == 1.0


@pytest.mark.parametrize(("env", "field", "value"), [
    ({"RINGSERVE_PAYLOAD_LANE": "tcp"}, "payload_lane", "tcp"),
    ({"RINGSERVE_PAYLOAD_LANE": "off"}, "payload_lane", "off"),
    ({"RINGSERVE_PAYLOAD_PORT": "50052"}, "payload_port", 50052),
    ({"RINGSERVE_PAYLOAD_ADVERTISE_PORT": "41001"}, "payload_advertise_port", 41001),
    ({"RINGSERVE_PAYLOAD_CONNECT_TIMEOUT_S": "0.25"}, "payload_connect_timeout_s", 0.25),
])
def test_the_lane_settings_come_from_the_environment(env: dict[str, str], field: str, value: object) -> None:
    assert getattr(WorkerConfig.from_env(env), field) == value


@pytest.mark.parametrize(("overrides", "named"), [
    ({"payload_lane": "udp"}, "payload_lane ('udp', RINGSERVE_PAYLOAD_LANE) must be one of auto, tcp, off"),
    ({"payload_port": 70000}, "payload_port (70000) must be in [0, 65535]"),
    ({"payload_advertise_port": -1}, "payload_advertise_port (-1) must be in [0, 65535]"),
    ({"payload_connect_timeout_s": 0}, "payload_connect_timeout_s (0) must be greater than zero"),
])
def test_a_bad_lane_setting_is_refused_naming_the_value(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        WorkerConfig(**overrides)  # type: ignore[arg-type]
    assert named in str(info.value)


@pytest.mark.parametrize(("env", "local", "ports"), [
    ({}, 3, {}),
    ({"RINGSERVE_PAYLOAD_PORT": "0"}, 1, {}),
    ({"RINGSERVE_PAYLOAD_PORT": "45000"}, 0, {"RINGSERVE_PAYLOAD_PORT": "45000"}),
    ({"RINGSERVE_PAYLOAD_PORT": "45000", "RINGSERVE_PAYLOAD_ADVERTISE_PORT": "55000"}, 2,
     {"RINGSERVE_PAYLOAD_PORT": "45002", "RINGSERVE_PAYLOAD_ADVERTISE_PORT": "55002"}),
    ({"RINGSERVE_PAYLOAD_PORT": "not a port"}, 1, {}),  # left for the worker's config to refuse, naming it
])
def test_the_launcher_gives_each_worker_of_a_host_its_own_pinned_payload_port(
    env: dict[str, str], local: int, ports: dict[str, str]
) -> None:
    assert payload_ports(env, local) == ports


@pytest.mark.parametrize(("address", "host"), [
    ("10.0.0.7:41234", "10.0.0.7"), ("[::1]:5", "::1"), ("worker-3.ns.svc:50052", "worker-3.ns.svc"),
])
def test_the_lane_is_dialled_at_the_host_of_the_senders_address(address: str, host: str) -> None:
    assert split_host(address) == host


def test_a_payload_is_sent_as_its_bytes_without_a_copy_when_contiguous() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = as_bytes(a)
    assert view.nbytes == 48 and view.format == "B" and bytes(view) == a.tobytes()
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), a)
    strided = a[:, ::2]
    assert bytes(as_bytes(strided)) == np.ascontiguousarray(strided).tobytes()
    assert bytes(as_bytes(memoryview(a))) == a.tobytes() and bytes(as_bytes(b"xyz")) == b"xyz"


def test_a_receive_buffer_is_reused_only_once_no_view_of_it_is_left() -> None:
    buffers = LaneBuffers(1 << 20, keep=2)
    first = buffers.take(POOLED_MIN)
    held = memoryview(first)  # a collective still reads it
    first_data = first.__array_interface__["data"][0]
    del first
    gc.collect()
    second = buffers.take(POOLED_MIN)
    assert second.__array_interface__["data"][0] != first_data and buffers.made == 2
    del held
    gc.collect()
    third = buffers.take(1 << 20)
    assert third.__array_interface__["data"][0] == first_data and buffers.made == 2
    small = buffers.take(100)  # small payloads take a fresh buffer of their own
    assert small.nbytes == 100 and buffers.made == 2
    del second, third, small
