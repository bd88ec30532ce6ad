"""The controller's phase: an explicit state with its allowed transitions written down, in the manner of h11's
state table. dprun.controller.state_machine enters a phase through `check_transition`; the simulator checks every step.

    FORMING     -> TRAINING; LOADING (a resume)
    LOADING     -> TRAINING (resumed); RECOVERING (a recovery from disk); LOADING (an older step); DECIDING (a node
                   lost while a recovery's files were read)
    TRAINING    -> DECIDING
    DECIDING    -> RECOVERING; WAITING; LOADING (state lost in memory, safe on disk); TRAINING (nothing to change)
    WAITING     -> DECIDING
    RECOVERING  -> TRAINING; DECIDING (a failure during the recovery)
    any phase but FINISHED -> SAVING (the job ends, --save-dir) -> FINISHED; any phase -> FINISHED

FORMING     nodes register until --nnodes are active (and the spares, or the rendezvous timeout).
LOADING     nodes read a step's files into their stores: a resumed job's start, or a recovery from disk.
TRAINING    a generation trains and no failure is known (its ranks may have finished and be exiting).
DECIDING    failures known (or a plan must change): every live node is probed, then the next generation planned.
WAITING     the plan waits: for a node to join as a spare (--on-spare-exhausted wait), or for a restore in flight
            whose state looked lost. News (a spare, a restore, the wait's end) makes it decide again.
RECOVERING  the next generation was sent out; it is complete when every rank has stepped past its restore step.
SAVING      the job ends, and first the nodes write its newest complete state to --save-dir.
FINISHED    the job's end was decided (Finish returned): nothing more is handled.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    FORMING = "forming"
    LOADING = "loading"
    TRAINING = "training"
    DECIDING = "deciding"
    WAITING = "waiting"
    RECOVERING = "recovering"
    SAVING = "saving"
    FINISHED = "finished"


_ENDS = {Phase.SAVING, Phase.FINISHED}

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.FORMING: frozenset({Phase.TRAINING, Phase.LOADING, *_ENDS}),
    # a resume's step read (-> TRAINING), a recovery's (-> RECOVERING), a damaged step: the one before (LOADING),
    # a node lost while a recovery's files were read: that recovery decides again (DECIDING)
    Phase.LOADING: frozenset({Phase.TRAINING, Phase.RECOVERING, Phase.LOADING, Phase.DECIDING, *_ENDS}),
    Phase.TRAINING: frozenset({Phase.DECIDING, *_ENDS}),
    # a plan: sent (RECOVERING), waiting (WAITING), from disk (LOADING), or nothing to change after all (TRAINING)
    Phase.DECIDING: frozenset({Phase.RECOVERING, Phase.WAITING, Phase.LOADING, Phase.TRAINING, *_ENDS}),
    Phase.WAITING: frozenset({Phase.DECIDING, *_ENDS}),
    Phase.RECOVERING: frozenset({Phase.TRAINING, Phase.DECIDING, *_ENDS}),
    Phase.SAVING: frozenset({Phase.SAVING, Phase.FINISHED}),  # (a step that failed to save: an older one)
    Phase.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A controller bug: a transition the table above does not allow."""


def check_transition(current: Phase, new: Phase) -> Phase:
    """`new`, if the table allows going there from `current` (staying in a phase is always allowed)."""
    if new is not current and new not in TRANSITIONS[current]:
        raise IllegalTransition(f"the controller cannot go from {current.name} to {new.name}")
    return new
