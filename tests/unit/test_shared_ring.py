"""The shared-memory ring on its own: attach, put, read in place, free, and every refusal.

The receiving side is this process; the sending side is this process too, or a child process,
so that the /proc/<pid>/fd path is crossed for real.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ringserve import ProtocolError, wire
from ringserve._proto import peer_pb2
from ringserve.worker.dataplane.links import shared
from ringserve.worker.dataplane.links.shared import InboundRing, OutboundRing

pytestmark = [pytest.mark.timeout(30), pytest.mark.skipif(not shared.supported(), reason="the fast path needs Linux memfd seals, /proc and x86-64")]


def frame_for(slot: int | None, nbytes: int) -> wire.FrameHeader:
    header = wire.FrameHeader(kind=wire.DATA)
    if slot is not None:
        header.shm_slot = slot
        header.shm_bytes = nbytes
    return header


@pytest.fixture
def pair():
    out = OutboundRing(slots=3, slot_bytes=64)
    inbound = InboundRing.attach(out.offer())
    assert inbound is not None
    yield out, inbound
    out.close()


def test_nothing_goes_through_the_ring_until_the_receiver_attaches() -> None:
    out = OutboundRing(slots=2, slot_bytes=64)
    try:
        assert not out.attached
        assert out.put(np.arange(4, dtype=np.float32)) is None
        assert InboundRing.attach(out.offer()) is not None
        assert out.attached
        assert out.put(np.arange(4, dtype=np.float32)) == 0
    finally:
        out.close()


def test_a_payload_is_read_in_place_and_its_slot_freed_when_the_last_view_is_dropped(pair) -> None:
    out, inbound = pair
    values = np.arange(16, dtype=np.float32)
    slot = out.put(values)
    assert slot == 0
    view = np.frombuffer(inbound.payload(frame_for(slot, values.nbytes)), dtype=np.float32)
    np.testing.assert_array_equal(view, values)
    # Written once by the sender: the receiver sees the same memory, not a copy.
    out.put(np.ones(16, dtype=np.float32))  # another slot; slot 0 is still in use
    part = view[4:8]
    del view
    gc.collect()
    assert out.put(np.zeros(1, dtype=np.float32)) == 2  # slot 0 is still held through part
    np.testing.assert_array_equal(part, values[4:8])
    del part
    assert out.put(np.zeros(1, dtype=np.float32)) == 0  # freed at once (reference counting)


def test_a_full_ring_or_a_payload_larger_than_a_slot_goes_in_the_frame(pair) -> None:
    out, inbound = pair
    views = [inbound.payload(frame_for(out.put(np.full(4, i, dtype=np.int32)), 16)) for i in range(3)]
    assert out.put(np.zeros(4, dtype=np.int32)) is None
    assert out.put(np.zeros(17, dtype=np.float32)) is None  # 68 bytes > 64
    assert out.put(b"") is None
    assert [np.frombuffer(v, dtype=np.int32).tolist() for v in views] == [[i] * 4 for i in range(3)]
    views.pop()
    assert out.put(b"\x01" * 64) == 2


def test_a_frame_naming_a_slot_out_of_range_or_in_use_is_refused(pair) -> None:
    out, inbound = pair
    with pytest.raises(ProtocolError, match=r"slot 3 of a shared ring of 3 slots"):
        inbound.payload(frame_for(3, 4))
    with pytest.raises(ProtocolError, match=r"65 bytes"):
        inbound.payload(frame_for(0, 65))
    with pytest.raises(ProtocolError, match=r"0 bytes"):
        inbound.payload(frame_for(0, 0))
    slot = out.put(np.zeros(4, dtype=np.float32))
    held = inbound.payload(frame_for(slot, 16))
    with pytest.raises(ProtocolError, match=r"still in use"):
        inbound.payload(frame_for(slot, 16))
    del held


def test_an_offer_from_another_host_a_wrong_token_or_a_missing_file_is_not_attached() -> None:
    out = OutboundRing(slots=2, slot_bytes=64)
    try:
        offer = out.offer()
        changes = [{"boot_id": "another-boot"}, {"token": b"\x00" * 16}, {"fd": 999_999}, {"slots": 3}]
        for change in changes:
            bad = peer_pb2.SharedRing()
            bad.CopyFrom(offer)
            for field, value in change.items():
                setattr(bad, field, value)
            assert InboundRing.attach(bad) is None, change
        assert not out.attached  # none of them wrote the echo
    finally:
        out.close()


def test_only_a_sealed_ringserve_memfd_is_ever_mapped(tmp_path) -> None:
    # A hostile offer names a file this process has open whose first bytes it knows (an ELF
    # header, a SQLite file): the size and token would match, but it is not a ring.
    size = shared._DATA + 64
    victim = tmp_path / "victim"
    victim.write_bytes(b"SQLite format 3\x00" + bytes(size - 16))
    fd = os.open(victim, os.O_RDONLY)
    unsealed = os.memfd_create(shared.NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, size)
        os.pwrite(unsealed, b"SQLite format 3\x00", 0)
        for target in (fd, unsealed):
            offer = peer_pb2.SharedRing(pid=os.getpid(), fd=target, token=b"SQLite format 3\x00",
                                        boot_id=shared.boot_id(), slots=1, slot_bytes=64)
            assert InboundRing.attach(offer) is None
        assert victim.read_bytes()[16:32] == bytes(16)  # no echo written into it
        assert os.pread(unsealed, 16, 16) == bytes(16)
    finally:
        os.close(fd)
        os.close(unsealed)


SENDER = textwrap.dedent("""
    import sys, numpy as np
    from ringserve.worker.dataplane.links.shared import OutboundRing
    out = OutboundRing(slots=2, slot_bytes=1 << 20)
    sys.stdout.write(out.offer().SerializeToString().hex() + "\\n"); sys.stdout.flush()
    sys.stdin.readline()                      # the parent has attached
    print(out.put(np.arange(1000, dtype=np.float64)), flush=True)
    sys.stdin.readline()                      # the parent has read and dropped the payload
    print(out.put(np.arange(10, dtype=np.float64)), flush=True)
""")


def test_a_ring_is_shared_across_processes_through_proc() -> None:
    child = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        offer = peer_pb2.SharedRing.FromString(bytes.fromhex(child.stdout.readline().strip()))
        inbound = InboundRing.attach(offer)
        assert inbound is not None
        child.stdin.write("\n")
        child.stdin.flush()
        slot = int(child.stdout.readline())
        view = np.frombuffer(inbound.payload(frame_for(slot, 8000)), dtype=np.float64)
        np.testing.assert_array_equal(view, np.arange(1000, dtype=np.float64))
        del view
        child.stdin.write("\n")
        child.stdin.flush()
        assert int(child.stdout.readline()) == slot  # freed by this process, reused by the child
    finally:
        child.kill()
        child.wait(10)


def shmem_kib() -> int:
    """Shared-memory pages mapped by this process (both ends of a ring that it holds)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_an_idle_ring_gives_its_pages_back_in_both_ends_but_never_while_a_slot_is_read() -> None:
    out = OutboundRing(slots=4, slot_bytes=4 << 20)
    try:
        inbound = InboundRing.attach(out.offer())
        assert inbound is not None
        payload = np.full(1 << 20, 7, dtype=np.float32)  # 4 MiB: a slot each
        before = shmem_kib()
        slots = [out.put(payload) for _ in range(3)]
        views = [np.frombuffer(inbound.payload(frame_for(s, payload.nbytes)), dtype=np.float32) for s in slots]
        assert all((v == 7).all() for v in views)  # read here: the receiver's mapping holds the pages too
        assert shmem_kib() - before >= 12 << 10
        del views[1:]
        assert out.release() == 0  # slot 0 is still read: nothing goes
        views.clear()
        assert out.release() == 3 * (4 << 20)
        assert shmem_kib() - before < 1 << 10
        assert out.release() == 0  # nothing written since
        slot = out.put(np.arange(8, dtype=np.float32))  # a given-back slot is written and read as before
        np.testing.assert_array_equal(np.frombuffer(inbound.payload(frame_for(slot, 32)), dtype=np.float32),
                                      np.arange(8, dtype=np.float32))
    finally:
        out.close()


def test_the_pages_go_after_the_ring_was_idle_for_release_after_s_not_while_payloads_keep_coming() -> None:
    async def scenario() -> tuple[int, int, int]:
        out = OutboundRing(slots=2, slot_bytes=1 << 20, release_after_s=0.05)
        try:
            inbound = InboundRing.attach(out.offer())
            assert inbound is not None
            for _ in range(15):  # 0.3 s of traffic, a payload every 20 ms, each read and dropped
                slot = out.put(np.ones(1 << 18, dtype=np.float32))
                inbound.payload(frame_for(slot, 1 << 20))
                await asyncio.sleep(0.02)
            busy = out.released_bytes
            await asyncio.sleep(0.25)  # idle: released within twice release_after_s
            idle = out.released_bytes
            out.put(np.ones(4, dtype=np.float32))  # arms the timer again, which close() cancels
        finally:
            out.close()
        await asyncio.sleep(0.15)  # a timer that outlived close() would release a closed ring here
        return busy, idle, out.released_bytes

    busy, idle, after_close = asyncio.run(scenario())
    assert busy == 0
    assert idle == 1 << 20
    assert after_close == idle
