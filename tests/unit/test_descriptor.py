"""A collective's descriptor is a frozen value with one encoding, parsed back in one place."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.ops import adasum, collectives, join

# Every kind of descriptor the collectives make, with the text ranks send (and users read in a
# MismatchError): these texts are the protocol between ranks.
MADE = [
    (Descriptor("allreduce", dtype="float32", shape=(4,), op="sum"), "allreduce float32 (4,) op=sum"),
    (Descriptor("allreduce", dtype="float64", shape=(4, 3), op="average", codec="int8"),
     "allreduce float64 (4, 3) op=average codec=int8"),
    (Descriptor("allreduce", dtype="int64", shape=(), op="max"), "allreduce int64 () op=max"),
    (adasum.descriptor_of(np.dtype(np.float32), (8,), [5, 3]), "allreduce float32 (8,) op=adasum parts=(5, 3)"),
    (adasum.descriptor_of(np.dtype(np.float32), (8,), [8]), "allreduce float32 (8,) op=adasum parts=(8,)"),
    (Descriptor("allreduce", dtype="float32", shape=(8,), op="sum").at_stage("local-reduce"),
     "allreduce float32 (8,) op=sum stage=local-reduce"),
    (Descriptor("allreduce", dtype="float32", shape=(8,), op="sum").at_stage("cross").refused("an earlier stage failed"),
     "allreduce float32 (8,) op=sum stage=cross invalid: an earlier stage failed"),
    (Descriptor("reduce_scatter", dtype="float16", shape=(6, 2), op="min"), "reduce_scatter float16 (6, 2) op=min"),
    (Descriptor("allreduce", dtype="float32", shape=(8,), op="sum", codec="fp16", algo="tree"),
     "allreduce float32 (8,) op=sum codec=fp16 algo=tree"),
    (Descriptor("allreduce", dtype="float32", shape=(8,), op="sum", stage="cross", algo="recursive_doubling"),
     "allreduce float32 (8,) op=sum stage=cross algo=recursive_doubling"),
    (Descriptor("broadcast", dtype="uint8", shape=(3,), root=2, algo="tree/2").refused("no"),
     "broadcast uint8 (3,) root=2 algo=tree/2 invalid: no"),
    (Descriptor("links", algo="probe"), "links algo=probe"),
    (Descriptor("broadcast", dtype="uint8", shape=(3,), root=2), "broadcast uint8 (3,) root=2"),
    (Descriptor("allgather", dtype="float32", rows=(17, 17)), "allgather float32 (*, 17, 17)"),
    (Descriptor("alltoall", dtype="int32", rows=()), "alltoall int32 (*, )"),
    (Descriptor("alltoall", dtype="int32", rows=(3,)).refused("splits [1] has 1 entries: wrong"),
     "alltoall int32 (*, 3) invalid: splits [1] has 1 entries: wrong"),
    (Descriptor("message", dtype="float64", count=5), "message float64 x5"),
    (Descriptor("broadcast_object", root=0), "broadcast_object root=0"),
    (Descriptor("allgather_object"), "allgather_object"),
    (collectives.BARRIER, "barrier"),
    (join.JOINING, "join"),
    (join.JOINED, "join stage=done"),
    (Descriptor("joined", problem="allgather is not supported while a rank has joined"),
     "joined invalid: allgather is not supported while a rank has joined"),
    (Descriptor("grouped_allgather", items=(Descriptor("", dtype="float32", rows=(3,)),
                                            Descriptor("", dtype="int64", rows=()))),
     "grouped_allgather [float32 (*, 3); int64 (*, )]"),
    (Descriptor("grouped_reduce_scatter", dtype="float32", op="sum", codec="fp16",
                items=(Descriptor("", dtype="float32", shape=(4, 3)), Descriptor("", dtype="int64", shape=(5,)))),
     "grouped_reduce_scatter float32 [float32 (4, 3); int64 (5,)] op=sum codec=fp16"),
]


@pytest.mark.parametrize(("descriptor", "text"), MADE, ids=[text for _, text in MADE])
def test_each_descriptor_encodes_to_its_text_and_parses_back_to_itself(descriptor: Descriptor, text: str) -> None:
    assert descriptor.text == text == str(descriptor)
    assert Descriptor.parse(text) == descriptor
    assert Descriptor.parse(text).text == text


def test_a_descriptor_is_frozen_and_compared_by_its_fields() -> None:
    d = Descriptor("allreduce", dtype="float32", shape=(4,), op="sum")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.op = "max"  # type: ignore[misc]
    assert d == Descriptor("allreduce", dtype="float32", shape=(4,), op="sum")
    assert d != d.refused("wrong") and d.refused("wrong").kind == "allreduce"
    assert {d: 1}[Descriptor.parse(d.text)] == 1


@pytest.mark.parametrize("text", [
    "", "Allreduce", "allreduce float32 (4,) op=", "allreduce float32 (4, x) op=sum", "allreduce  float32",
    "allreduce float32 (4,) op=sum codec=int8 op=max", "message float64 x", "grouped_allgather [float32 (*, 3);]",
    "allreduce float32 (4,)op=sum", "broadcast_object root=-1", "allreduce float32 (4 ,) op=sum",
])
def test_a_text_that_no_rank_would_write_is_a_protocol_error_naming_it(text: str) -> None:
    with pytest.raises(ProtocolError, match="is not a collective's descriptor"):
        Descriptor.parse(text)


def test_a_joined_rank_reads_what_it_stands_in_for_from_the_parsed_descriptor() -> None:
    # join's decision reads the typed fields, never the text.
    zeros = join.stand_in(Descriptor.parse("allreduce float64 (7,) op=sum codec=int8"))
    assert zeros == join.Zeros(np.dtype(np.float64), (7,), "sum", "int8")
    assert join.stand_in(Descriptor("allreduce", dtype="nosuchtype", shape=(1,), op="sum")) == join.Refuse(
        "allreduce is not supported while a rank has joined (as in Horovod: only allreduce and barrier are)")
