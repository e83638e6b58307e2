"""The payload lane's pure parts: its settings, the launcher's ports for a host's workers, byte
views of payloads, and the receive buffers' reuse."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

from ringserve import wire
from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError
from ringserve.launch.group import payload_ports
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.hub import split_host
from ringserve.worker.dataplane.lanes.tcp.frames import FrameParser, Landings
from ringserve.worker.dataplane.lanes.tcp.inbound import POOLED_MIN, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.outbound import as_bytes


def test_the_lane_is_on_by_default_with_any_free_port_and_a_one_second_connect_deadline() -> None:
    config = WorkerConfig()
    assert (config.payload_lane, config.payload_port, config.payload_advertise_port) == ("auto", 0, 0)
    assert config.payload_connect_timeout_s == 1.0
    assert config.payload_congestion == "cubic"


@pytest.mark.parametrize(("env", "field", "value"), [
    ({"RINGSERVE_PAYLOAD_LANE": "tcp"}, "payload_lane", "tcp"),
    ({"RINGSERVE_PAYLOAD_LANE": "off"}, "payload_lane", "off"),
    ({"RINGSERVE_PAYLOAD_PORT": "50052"}, "payload_port", 50052),
    ({"RINGSERVE_PAYLOAD_ADVERTISE_PORT": "41001"}, "payload_advertise_port", 41001),
    ({"RINGSERVE_PAYLOAD_CONNECT_TIMEOUT_S": "0.25"}, "payload_connect_timeout_s", 0.25),
    ({"RINGSERVE_PAYLOAD_CONGESTION": "system"}, "payload_congestion", "system"),
    ({"RINGSERVE_PAYLOAD_CONGESTION": "bbr"}, "payload_congestion", "bbr"),
])
def test_the_lane_settings_come_from_the_environment(env: dict[str, str], field: str, value: object) -> None:
    assert getattr(WorkerConfig.from_env(env), field) == value


@pytest.mark.parametrize(("overrides", "named"), [
    ({"payload_lane": "udp"}, "payload_lane ('udp', RINGSERVE_PAYLOAD_LANE) must be one of auto, tcp, off"),
    ({"payload_port": 70000}, "payload_port (70000) must be in [0, 65535]"),
    ({"payload_advertise_port": -1}, "payload_advertise_port (-1) must be in [0, 65535]"),
    ({"payload_connect_timeout_s": 0}, "payload_connect_timeout_s (0) must be greater than zero"),
    ({"payload_congestion": "Cubic; rm"}, "payload_congestion ('Cubic; rm', RINGSERVE_PAYLOAD_CONGESTION) must name"),
    ({"payload_congestion": ""}, "payload_congestion ('', RINGSERVE_PAYLOAD_CONGESTION) must name"),
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


# -- payloads read straight into a result (laneframes.Landings) ---------------------------------


def data_header(**fields: object) -> wire.FrameHeader:
    base = {"kind": wire.DATA, "view_id": 3, "sender_rank": 1, "op_key": "g#1", "step": 2, "chunk": 0,
            "dtype": wire.dtype_code(np.dtype(np.float32)), "count": POOLED_MIN // 4, "lane_bytes": POOLED_MIN}
    return wire.FrameHeader(**{**base, **fields})  # type: ignore[arg-type]


def offered(result: np.ndarray) -> Landings:
    landings = Landings()
    landings.offer(3, "g#1", [(2, 0, result[: POOLED_MIN // 4])], wire.dtype_code(result.dtype))
    return landings


@pytest.mark.parametrize("differs", [{"view_id": 4}, {"op_key": "g#2"}, {"step": 3},
                                     {"chunk": 1}, {"dtype": wire.dtype_code(np.dtype(np.int32))},
                                     {"count": POOLED_MIN // 4 - 1}, {"lane_bytes": POOLED_MIN - 4}])
def test_a_frame_lands_only_where_everything_about_it_is_as_offered(differs: dict[str, object]) -> None:
    result = np.zeros(POOLED_MIN // 4 * 2, dtype=np.float32)
    landings = offered(result)
    assert landings.claim(data_header(**differs), stop=lambda: None) is None
    region = landings.claim(data_header(), stop=lambda: None)
    assert region is not None and region.ctypes.data == result.ctypes.data and region.nbytes == POOLED_MIN
    assert not landings.withdraw(3, "g#1")  # claimed and not yet read
    landings.read(data_header())
    assert landings.withdraw(3, "g#1") and landings.landed == 1
    assert landings.claim(data_header(), stop=lambda: None) is None  # a region lands one frame, once


def test_a_region_smaller_than_the_pooled_minimum_is_never_offered() -> None:
    result = np.zeros(POOLED_MIN // 4, dtype=np.float32)
    landings = Landings()
    landings.offer(3, "g#1", [(2, 0, result[:-1])], wire.dtype_code(result.dtype))
    assert landings.claim(data_header(count=POOLED_MIN // 4 - 1, lane_bytes=POOLED_MIN - 4), stop=lambda: None) is None


async def test_a_collective_that_ends_mid_read_stops_the_lane_and_waits_for_its_thread() -> None:
    result = np.zeros(POOLED_MIN // 4, dtype=np.float32)
    landings = offered(result)
    stopped: list[float] = []
    header = data_header()

    def stop() -> None:  # as a lane's close: its thread leaves the socket a moment later
        stopped.append(time.monotonic())
        asyncio.get_running_loop().call_later(0.05, landings.read, header, False)

    assert landings.claim(header, stop=stop) is not None
    started = time.monotonic()
    assert not landings.withdraw(3, "g#1")
    await landings.withdrawn(3, "g#1", grace_s=0.2)
    assert stopped and stopped[0] - started >= 0.19  # the read had its grace first
    assert landings.withdraw(3, "g#1") and landings.landed == 0


def test_the_parser_reads_a_claimed_payload_into_the_result_and_hands_on_a_read_only_view() -> None:
    result = np.zeros(POOLED_MIN // 4, dtype=np.float32)
    buffers = LaneBuffers(1 << 20)
    buffers.landings.offer(3, "g#1", [(2, 0, result)], wire.dtype_code(result.dtype))
    payload = np.arange(result.size, dtype=np.float32)
    raw = wire.encode(data_header())
    stream = memoryview(len(raw).to_bytes(4, "little") + raw + payload.tobytes())
    at = 0

    def read(view: memoryview, whole: bool, landed: bool) -> int | None:
        nonlocal at
        n = min(view.nbytes, len(stream) - at, 1000 if not whole else 1 << 30)
        if n == 0:
            return None
        view[:n] = stream[at : at + n]
        at += n
        return n

    got: list[Received] = []
    FrameParser(read, buffers, 1 << 21, "here", got.append, lambda exc: None, lambda: None, stop=lambda: None).pump()
    assert len(got) == 1 and np.array_equal(result, payload)
    assert np.frombuffer(got[0].payload, dtype=np.float32).ctypes.data == result.ctypes.data
    assert got[0].payload.readonly and result.flags.writeable
    assert buffers.landings.landed == 1 and buffers.made == 0
