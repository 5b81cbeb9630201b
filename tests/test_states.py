"""The vocabularies in shared/states.py say what their users assume of them."""

from __future__ import annotations

from llmgw.shared import states as S
from llmgw.shared.states import AdminState, EngineState, EventWhat, LeaseState, NodeState, ReplicaState


def test_a_replica_event_is_the_state_it_entered_and_a_lease_event_the_lease_state():
    """The scheduler announces a replica's transition by its new state and the health
    monitor a lease's by its new lease state: each is an event word."""
    for state in (*ReplicaState, *LeaseState):
        assert EventWhat(state).known, state


def test_a_node_word_is_a_lease_word_an_admin_word_or_unknown():
    """``readmodel.node_state`` folds a lease state and an admin state into one word."""
    assert {*LeaseState, *AdminState} - {AdminState.ACTIVE} | {NodeState.UNKNOWN} == set(NodeState)
    assert S.NODE_ORDER[:2] == (NodeState.LOST, NodeState.SUSPECT)  # most urgent first


def test_the_replica_sets():
    R = ReplicaState
    # every state but gone holds its GPUs
    assert set(R) - S.HOLDING_REPLICA == {R.GONE}
    # "starting": launched and not yet serving; the console adds pending
    assert S.LAUNCHED_REPLICA == {R.LAUNCHING, R.WAITING}
    assert S.COMING_UP_REPLICA == S.LAUNCHED_REPLICA | {R.PENDING, R.RESTARTING}
    assert not S.COMING_UP_REPLICA & (S.ROUTABLE_REPLICA | S.ENDING_REPLICA)
    assert S.LAUNCHED_REPLICA <= S.ACTIVE_REPLICA and S.LAUNCHED_REPLICA <= S.IN_FLIGHT_REPLICA
    # a standby spare is up and watched (active, wanted, holding) but never routed, and settled
    assert R.STANDBY in S.ACTIVE_REPLICA and R.STANDBY in S.WANTED_REPLICA
    assert R.STANDBY not in S.ROUTABLE_REPLICA | S.SERVING_REPLICA | S.IN_FLIGHT_REPLICA | S.COMING_UP_REPLICA
    # restarting in place: wanted (it comes back on what it holds), not yet settled, not active
    assert R.RESTARTING in S.WANTED_REPLICA & S.IN_FLIGHT_REPLICA and R.RESTARTING not in S.ACTIVE_REPLICA | S.ROUTABLE_REPLICA
    assert S.ROUTABLE_REPLICA <= S.SERVING_REPLICA <= S.ACTIVE_REPLICA


def test_the_engine_sets():
    E = EngineState
    assert S.UP_ENGINE <= S.RUNNING_ENGINE and E.STARTING not in S.UP_ENGINE
    assert S.REPORTED_ENGINE == set(E) - {E.ABSENT, E.UNREPORTED}


def test_every_word_is_one_member_of_its_vocabulary():
    """No vocabulary spells one word twice (an alias member would be a second name)."""
    for vocabulary in S.VOCABULARIES:
        assert len(vocabulary.__members__) == len(list(vocabulary)), vocabulary
