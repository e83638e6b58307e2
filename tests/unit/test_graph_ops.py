"""The carrier of ringserve errors through a framework's graph ops (ringserve/graph_ops.py).

The end-to-end case (TensorFlow reports a dead rank inside model.fit, and hvd.elastic.run goes back
to the last commit) is tests/keras/test_keras_elastic.py's TensorFlow run.
"""

from __future__ import annotations

import pytest

from ringserve import graph_ops
from ringserve.errors import PeerUnavailableError


def _fail() -> None:
    raise PeerUnavailableError("The stream from rank 2 of view 1 broke.")


def _as_a_framework_reports(call: object) -> RuntimeError:
    """Runs ``call`` and returns what a framework raises in its place: its own error, the text kept."""
    try:
        call()  # type: ignore[operator]
    except Exception as exc:
        return RuntimeError(f"Traceback ...\nringserve.errors.{type(exc).__name__}: {exc}\n [[{{{{node PyFunc}}}}]]")
    raise AssertionError("the call did not raise")


def test_an_error_raised_in_a_graph_op_is_found_again_in_the_frameworks_error() -> None:
    reported = _as_a_framework_reports(graph_ops.carry(_fail))
    found = graph_ops.raised_in_graph(reported)
    assert isinstance(found, PeerUnavailableError)
    assert "rank 2 of view 1" in str(found)
    assert graph_ops.raised_in_graph(reported) is None  # taken once


def test_an_unrelated_framework_error_is_left_as_it_is() -> None:
    _as_a_framework_reports(graph_ops.carry(_fail))
    assert graph_ops.raised_in_graph(ValueError("shapes (2,) and (3,) are incompatible")) is None


def test_translate_raises_the_carried_error_in_place_of_the_frameworks() -> None:
    def body() -> None:
        raise _as_a_framework_reports(graph_ops.carry(_fail))

    with pytest.raises(PeerUnavailableError, match="rank 2 of view 1") as raised:
        graph_ops.translate(body)()
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_translate_leaves_other_errors_alone() -> None:
    def body() -> None:
        raise ValueError("a bad batch")

    with pytest.raises(ValueError, match="a bad batch"):
        graph_ops.translate(body)()
