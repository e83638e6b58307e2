"""ringserve.elastic.rider's healing hooks, pure: what waits for this rank's next optimizer step
(a root's tensors for a healing joiner, ``after_step``) runs once when it comes (``stepped``),
and a failure forgets it along with the heal (``drop_heal``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ringserve.elastic import rider


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    rider.drop_heal()
    yield
    rider.drop_heal()


def test_what_waits_for_the_next_step_runs_once_when_it_has_its_reductions() -> None:
    ran: list[str] = []
    rider.after_step(lambda: ran.append("a"))
    rider.after_step(lambda: ran.append("b"))
    assert ran == []
    rider.stepped()
    assert ran == ["a", "b"]
    rider.stepped()
    assert ran == ["a", "b"]


def test_a_failure_forgets_the_heal_and_what_waited_for_the_step() -> None:
    ran: list[str] = []
    rider.begin_heal(lambda: ran.append("heal"))
    rider.after_step(lambda: ran.append("send"))
    assert rider.healing()
    rider.drop_heal()
    rider.heal()
    rider.stepped()
    assert ran == [] and not rider.healing()
