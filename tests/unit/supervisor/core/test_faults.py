"""The fault-kind table (supervisor.core.faults) holds to the rest of the core.

Adding a kind of agent report to the core is an entry in the table, a type in
observations.py and a case in decide: these tests fail until all three agree.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from agent.wire.protocol import Event, EventKind
from supervisor.core import faults
from supervisor.core.blame import blame
from supervisor.core.decision import Policy
from supervisor.core.faults import BY_KIND, DECIDED_KINDS, FAULTS, REPLAYED_KINDS
from supervisor.core.model import Cause, JobState
from supervisor.core.observations import AgentObservation
from supervisor.core.policy import decide
from tests.unit.policy_world import CLUSTER, NOW, POLICY, running

POLICY_FIELDS = {field.name for field in dataclasses.fields(Policy)}


def _event(kind: EventKind) -> Event:
    return Event(kind, "42", "node2", "42/node2/abcdef01/1", 1, NOW - 1, {})


def test_each_kind_has_one_entry_and_each_observation_type_one_kind() -> None:
    assert len(BY_KIND) == len(FAULTS)
    # A kind decided through its entry alone brings its reading and decision with it;
    # every other kind's type is one of the core's own, with its case in decide.
    own = [fault for fault in FAULTS if fault.decide is None]
    assert all(fault.read is None for fault in own)
    named = sorted(fault.observation.__name__ for fault in own)
    assert named == sorted(kind.__name__ for kind in get_args(AgentObservation))
    assert all(fault.observation.KIND is fault.kind for fault in FAULTS)


@pytest.mark.parametrize("kind", sorted(DECIDED_KINDS, key=lambda k: k.value))
def test_every_decided_kind_is_read_into_its_entrys_observation_type(kind: EventKind) -> None:
    assert type(faults.read(_event(kind))) is BY_KIND[kind].observation


@pytest.mark.parametrize("kind", sorted(set(EventKind) - DECIDED_KINDS, key=lambda k: k.value))
def test_a_kind_without_an_entry_is_no_observation(kind: EventKind) -> None:
    with pytest.raises(ValueError, match=kind.value):
        faults.read(_event(kind))


@pytest.mark.parametrize("fault", FAULTS, ids=lambda fault: fault.kind.value)
@pytest.mark.parametrize(
    "state", [JobState.RUNNING, JobState.RECOVERING, JobState.REQUEUED], ids=str
)
def test_decide_has_a_case_for_every_entrys_observation(
    fault: faults.Fault, state: JobState
) -> None:
    observation = fault.observation("node2", "42/node2/abcdef01/1", NOW - 1)
    decision = decide(running(state=state), observation, NOW, POLICY, CLUSTER)
    assert decision.cause is None or decision.cause in fault.causes


@pytest.mark.parametrize("fault", FAULTS, ids=lambda fault: fault.kind.value)
def test_an_entrys_blame_rule_is_the_one_blame_applies(fault: faults.Fault) -> None:
    observation = fault.observation("node2", "42/node2/abcdef01/1", NOW - 1)
    if fault.decide is not None:
        # Decided through the table: its rule is the blame, whatever blame() says.
        assert fault.blame is not None or fault.causes == ()
        return
    verdict = blame(observation, running())
    if fault.blame is None:
        assert verdict.node is None and verdict.confidence == 0.0
    else:
        assert fault.blame(observation, running(), frozenset()) == verdict
        assert verdict.cause in fault.causes


@pytest.mark.parametrize("fault", FAULTS, ids=lambda fault: fault.kind.value)
def test_an_entrys_knobs_are_policy_fields_and_its_text_says_something(
    fault: faults.Fault,
) -> None:
    assert set(fault.knobs) <= POLICY_FIELDS
    assert all(isinstance(cause, Cause) for cause in fault.causes)
    assert len(fault.text) > 40


def test_the_replayed_kinds_are_the_decided_ones_but_the_measured_and_the_drivers() -> None:
    assert set(REPLAYED_KINDS) == DECIDED_KINDS - {EventKind.STRAGGLER, EventKind.TIME_LIMIT_NEAR}


def test_a_report_of_a_type_with_no_decision_is_an_error_not_a_tick() -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    from supervisor.core.observations import AgentReport
    from supervisor.core.policy import decide
    from tests.unit.policy_world import CLUSTER, POLICY

    @dataclass(frozen=True, kw_only=True)
    class Unheard(AgentReport):
        KIND: ClassVar[EventKind] = EventKind.STEP_LOSSES

    with pytest.raises(TypeError, match="Unheard has no decision"):
        decide(running(), Unheard("node2", "42/node2/abcdef01/1", NOW), NOW, POLICY, CLUSTER)
