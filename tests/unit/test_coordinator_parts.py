"""The coordinator's domain beside its servicer, without sockets: one put's chunks (params.Upload),
the caps on WatchView streams, the stall inspector and the commit ledger."""

from __future__ import annotations

import pytest

from ringserve.commits import Commit
from ringserve.coordinator.ledger import RECENT_VIEWS, CommitLedger
from ringserve.coordinator.membership import MemberInfo, ViewInfo
from ringserve.coordinator.params import ParamsFullError, ParamsInvalidError, ParamStore, Upload
from ringserve.coordinator.stalls import StallInspector
from ringserve.coordinator.watches import WatchCaps, WatchRefusedError


def view(view_id: int, *ids: str) -> ViewInfo:
    return ViewInfo(view_id, tuple(MemberInfo(w, f"10.0.0.{i}:1", "h", -1, i) for i, w in enumerate(ids)))


def test_a_put_is_counted_whole_from_its_first_chunk_and_released_at_its_end() -> None:
    store = ParamStore(max_bytes=10)
    upload = Upload(store)
    upload.add("w", 0, 6, b"abc")
    assert store.streaming_bytes == 6
    with pytest.raises(ParamsFullError, match="max_param_bytes"):
        Upload(store).add("other", 0, 5, b"x")  # 6 + 5 > 10: refused at once, nothing counted
    assert store.streaming_bytes == 6
    upload.add("w", 3, 6, b"def")
    assert upload.commit() == 1 and store.get("w") == b"abcdef"
    upload.release()
    assert store.streaming_bytes == 0 and store.stored_bytes == 6
    upload.release()  # a second release gives back nothing more
    assert store.streaming_bytes == 0


@pytest.mark.parametrize(("chunks", "message"), [
    ([("w", 0, 4, b"ab"), ("w", 3, 4, b"cd")], "at offset 3 does not follow the 2 bytes received so far of 4"),
    ([("w", 0, 4, b"ab"), ("w", 2, 5, b"cd")], "at offset 2 does not follow"),
    ([("w", 0, 2, b"abc")], "'w' is longer than its total"),
])
def test_chunks_that_do_not_make_their_blob_are_refused_naming_the_key(
        chunks: list[tuple[str, int, int, bytes]], message: str) -> None:
    store = ParamStore(max_bytes=100)
    upload = Upload(store)
    with pytest.raises(ParamsInvalidError, match=message):
        for chunk in chunks:
            upload.add(*chunk)
    upload.release()
    assert store.streaming_bytes == 0 and store.get("w") is None


def test_a_blob_cut_short_is_not_stored() -> None:
    store = ParamStore(max_bytes=100)
    upload = Upload(store)
    upload.add("w", 0, 4, b"ab")
    with pytest.raises(ParamsInvalidError, match="'w' ended after 2 of 4 bytes"):
        upload.commit()
    upload.release()
    assert store.get("w") is None and store.streaming_bytes == 0


def test_watch_streams_are_capped_in_all_and_per_worker_and_the_last_release_is_told() -> None:
    caps = WatchCaps(cap=3, per_worker=2)
    caps.admit("a")
    caps.admit("a")
    with pytest.raises(WatchRefusedError, match=r"'a' already holds 2 WatchView streams.*max_watches_per_worker"):
        caps.admit("a")
    caps.admit("b")
    with pytest.raises(WatchRefusedError, match=r"already serves 3 WatchView streams.*max_watch_streams"):
        caps.admit("c")
    assert caps.open == 3
    assert caps.release("a") is False and caps.release("a") is True and caps.release("b") is True
    assert caps.open == 0


def test_the_stall_inspector_names_the_ranks_missing_and_logs_each_collective_once_per_view() -> None:
    stalls = StallInspector()
    v = view(4, "a", "b", "c")
    stalls.heard("a", 4, frozenset({"grad.0"}))
    stalls.heard("c", 4, frozenset({"grad.0"}))
    warnings, new = stalls.warnings(v, 4, frozenset({"grad.0"}))
    assert warnings == new == ["'grad.0': ranks 1 have not submitted it; ranks 0, 2 wait"]
    assert stalls.warnings(v, 4, frozenset({"grad.0"}))[1] == []  # logged once in this view
    assert stalls.warnings(v, 3, frozenset({"grad.0"})) == ([], [])  # not the current view
    stalls.forget("c")
    assert stalls.reported() == {"a": (4, frozenset({"grad.0"}))}


def test_the_ledger_names_every_member_of_the_view_a_commit_was_made_in_and_keeps_few_views() -> None:
    ledger = CommitLedger()
    ledger.view_published(view(1, "a", "b"))
    before, after = ledger.record(worker_id="a", address="x", view_id=1, held=Commit(0, 5), made_in=1)
    assert (before, after) == (None, Commit(0, 5))
    assert [(h.worker_id, h.rank) for h in ledger.mark.holders] == [("a", 0), ("b", 1)]
    _, after = ledger.record(worker_id="c", address="y", view_id=9, held=Commit(0, 6), made_in=0)
    assert after == Commit(0, 6) and [(h.worker_id, h.rank) for h in ledger.mark.holders] == [("c", -1)]
    for v in range(2, 3 + RECENT_VIEWS):
        ledger.view_published(view(v, "a"))
    # View 1 is forgotten: a report from it names no rank.
    ledger.record(worker_id="a", address="x", view_id=1, held=Commit(0, 7), made_in=0)
    assert [(h.worker_id, h.rank) for h in ledger.mark.holders] == [("a", -1)]
