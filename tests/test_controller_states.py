"""The controller's explicit phases (dprun.controller.phase): the transition table refuses what it does not list, and
random fault schedules drive the simulated controller through the table's paths, each transition checked as it is taken.
"""

from __future__ import annotations

import collections

import pytest

import dprun.controller.state_machine
from dprun.controller.nodes import Role
from dprun.controller.phase import TRANSITIONS, IllegalTransition, Phase, check_transition
from dprun.sim.runner import run_schedule
from dprun.sim.schedule import random_schedule

pytestmark = pytest.mark.timeout(120)


def test_the_table_names_every_phase_and_finished_is_final():
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.FINISHED] == frozenset()
    assert all(Phase.FINISHED in TRANSITIONS[phase] for phase in Phase if phase is not Phase.FINISHED)


@pytest.mark.parametrize("current, new", [(Phase.FINISHED, Phase.TRAINING), (Phase.TRAINING, Phase.RECOVERING),
                                          (Phase.FORMING, Phase.DECIDING), (Phase.SAVING, Phase.TRAINING)])
def test_a_transition_the_table_does_not_list_raises(current, new):
    with pytest.raises(IllegalTransition, match=f"from {current.name} to {new.name}"):
        check_transition(current, new)


def test_staying_in_a_phase_is_no_transition():
    assert check_transition(Phase.DECIDING, Phase.DECIDING) is Phase.DECIDING


def test_random_fault_schedules_take_the_recovery_paths_of_the_table(monkeypatch):
    """Every transition the controller takes is checked against the table as it is taken (and the simulator's
    invariant 12 holds the phase equal to the records after every input); these schedules take the table's
    recovery paths: a swap, a wait for a spare, a recovery from disk, a save as the job ends."""
    taken: collections.Counter = collections.Counter()

    def recording(current: Phase, new: Phase) -> Phase:
        taken[current, new] += 1
        return check_transition(current, new)

    monkeypatch.setattr(dprun.controller.state_machine, "check_transition", recording)
    for seed in range(200):
        run_schedule(random_schedule(seed))
    expected = {(Phase.FORMING, Phase.TRAINING), (Phase.TRAINING, Phase.DECIDING),
                (Phase.DECIDING, Phase.RECOVERING), (Phase.RECOVERING, Phase.TRAINING),
                (Phase.RECOVERING, Phase.DECIDING), (Phase.DECIDING, Phase.WAITING), (Phase.WAITING, Phase.DECIDING),
                (Phase.DECIDING, Phase.LOADING), (Phase.LOADING, Phase.RECOVERING), (Phase.DECIDING, Phase.SAVING),
                (Phase.SAVING, Phase.FINISHED), (Phase.TRAINING, Phase.FINISHED)}
    assert expected <= set(taken), sorted(expected - set(taken))


def test_roles_are_the_strings_the_wire_and_events_carry():
    assert [role.value for role in Role] == ["active", "spare", "failed"]
    assert Role.SPARE == "spare" and f"{Role.FAILED}" == "failed"
