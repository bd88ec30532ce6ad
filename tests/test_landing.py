"""Landing (dpstate.snapshot.landing, dpstate.snapshot.optim.AdamW): an optimizer step writes its result into the next
snapshot's buffer, so that the capture copies nothing, while the previous snapshot stays intact; results stay torch's,
bit for bit. Replicators here send to a real replica store (dpagent's ReplicaServer) over loopback."""

from __future__ import annotations

import pytest
import torch

import dpstate
from dpcommon import protocol as P
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.replication.replicator import Replicator
from dpstate.snapshot.state import Tracked
from helpers.fake_agents import TOKEN

pytestmark = pytest.mark.timeout(60)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 4))


def backward(m: torch.nn.Module, step: int) -> None:
    torch.manual_seed(1000 + step)
    m.zero_grad()
    m(torch.randn(8, 16)).pow(2).mean().backward()


def reference_states(steps: int, **options) -> list[dict]:
    """torch.optim.AdamW's model and optimizer state after each step 0..steps (0: before training)."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), **options)
    states = [S.unpack(*pack(Tracked(), m, opt, 0))]
    for step in range(1, steps + 1):
        backward(m, step)
        opt.step()
        states.append(S.unpack(*pack(Tracked(), m, opt, step)))
    return states


def pack(tracked: Tracked, m: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[bytes, torch.Tensor]:
    if not tracked.objects:
        tracked.add(model=m, optimizer=opt)
    return S.pack(tracked.capture(step))


def same_state(tree: dict, expected: dict) -> bool:
    """Model and optimizer state equal bit for bit (the RNG and the rest differ between the two runs)."""
    for name in ("model", "optimizer"):
        got, want = S.flatten(tree["state"][name])[1], S.flatten(expected["state"][name])[1]
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


def sender(replica) -> Replicator:
    """Rank 1's replicator, sending to the replica store."""
    rep = Replicator(P.Codec(TOKEN), 1, AbortSignal())
    rep.configure(0, replica.replica_endpoint, 1)
    return rep


def held_by(replica, step: int) -> dict:
    """Rank 1's snapshot of `step` as the replica store holds it, fetched by another rank."""
    stored = Replicator(P.Codec(TOKEN), 2, AbortSignal()).fetch(replica.replica_endpoint, 1, step, timeout=10)
    return S.unpack(stored.meta, stored.data)


def slot_memory(rep: Replicator) -> list[tuple[int, int]]:
    return [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in rep.slots]


def lies_in_a_slot(t: torch.Tensor, rep: Replicator) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in slot_memory(rep))


def train(rep: Replicator, steps: int, every: int = 1, **options):
    """What a Job does around each step: the gate (wait_acked), the landing, the step, the capture."""
    m = model()
    opt = dpstate.AdamW(m.parameters(), **options)
    tracked = Tracked()
    tracked.add(model=m, optimizer=opt)
    rep.submit(0, tracked.capture(0))
    for step in range(1, steps + 1):
        backward(m, step)
        rep.wait_acked(timeout=10)
        opt.landing = rep.land()
        opt.step()
        if step % every == 0:
            rep.submit(step, tracked.capture(step))
        yield step, m, opt, tracked


@pytest.mark.parametrize("options", [dict(lr=3e-3, weight_decay=0.01), dict(lr=1e-2, weight_decay=0.0, maximize=True)],
                         ids=["weight-decay", "no-decay-maximize"])
def test_adamw_is_torchs_adamw_bit_for_bit_whether_or_not_it_lands(options):
    """Out of place or in place, dpstate.AdamW makes exactly torch's numbers (its default CPU step)."""
    expected = reference_states(12, **options)
    m = model()
    opt = dpstate.AdamW(m.parameters(), **options)
    for step in range(1, 13):
        backward(m, step)
        opt.landing = (lambda t: torch.empty_like(t)) if step % 3 else (lambda t: t)
        opt.step()
        assert opt.landing is None  # one step at a time
        assert same_state(S.unpack(*pack(Tracked(), m, opt, step)), expected[step]), f"step {step} differs"


def test_options_it_does_not_cover_take_torchs_own_step():
    m = model()
    opt = dpstate.AdamW(m.parameters(), amsgrad=True)
    backward(m, 1)
    opt.step()
    backward(m, 2)
    before = [p.data_ptr() for p in m.parameters()]
    opt.landing = lambda t: torch.empty_like(t)
    opt.step()
    assert not opt.lands() and [p.data_ptr() for p in m.parameters()] == before


def test_every_step_lands_in_the_older_buffer_and_the_previous_snapshot_stays_intact(replica):
    """Per-step snapshots: from the second step on, the parameters and moments lie in the slot whose snapshot
    is captured next, which the capture then finds in place; the previous snapshot, in the other slot, is
    the previous step's state bit for bit, and so is what the replica store holds."""
    expected = reference_states(10, lr=3e-3)
    rep = sender(replica)
    for step, m, opt, _ in train(rep, 10, lr=3e-3):
        rep.wait_acked(timeout=10)
        held = rep.local(step)
        assert held is not None and same_state(S.unpack(held.meta, held.data), expected[step])
        if step >= 3:  # step 1 makes the moments (torch's step), step 2 lands for the first time
            assert all(lies_in_a_slot(t, rep) for t in opt.state_dict()["state"][0].values() if t.dim())
            assert all(lo <= p.data_ptr() < hi for p in m.parameters() for lo, hi in [
                (held.buffer.data_ptr(), held.buffer.data_ptr() + held.nbytes)]), "the step did not land in the capture's slot"
            previous = rep.local(step - 1)
            assert previous is not None and previous is not held
            assert same_state(S.unpack(previous.meta, previous.data), expected[step - 1]), "the step wrote over the previous snapshot"
    state_bytes = sum(3 * p.numel() * p.element_size() for p in m.parameters())  # parameters + 2 moments
    assert rep.stats.landed_bytes == (10 - 1) * state_bytes, "captures copied what had landed"  # steps 2..10
    assert same_state(held_by(replica, 10), expected[10])


def test_between_snapshots_the_state_stays_in_the_scratch_buffer_and_the_snapshot_is_kept(replica):
    """Every 3rd step: the step after a snapshot moves the state out of its buffer, the next ones update it
    in place; the newest snapshot is intact all along and the run is torch's."""
    expected = reference_states(12, lr=3e-3)
    rep = sender(replica)
    for step, m, opt, tracked in train(rep, 12, every=3, lr=3e-3):
        rep.wait_acked(timeout=10)
        newest = max(rep.local_steps())
        assert newest == step - step % 3
        held = rep.local(newest)
        assert same_state(S.unpack(held.meta, held.data), expected[newest])
        assert same_state(S.unpack(*S.pack(tracked.capture(step))), expected[step])
        if step > 3 and step % 3:
            assert not any(held.buffer.data_ptr() <= p.data_ptr() < held.buffer.data_ptr() + held.nbytes
                           for p in m.parameters()), "the state lies in the buffer of the newest snapshot"


def test_go_home_leaves_the_buffers_and_the_state_is_unchanged(replica):
    """A reconfiguration (dpstate.steps.session) sends the state back to its own memory before the buffers are
    reused; a buffer written afterwards leaves the model alone."""
    rep = sender(replica)
    for step, m, opt, tracked in train(rep, 4, lr=3e-3):
        pass
    rep.wait_acked(timeout=10)
    assert any(lies_in_a_slot(p, rep) for p in m.parameters())
    before = S.unpack(*S.pack(tracked.capture(4)))
    opt.go_home()
    rep.unland()
    assert not any(lies_in_a_slot(t, rep) for t in [*m.parameters(), *S.flatten(opt.state_dict())[1]])
    for slot in rep.slots:
        slot.buffer.fill_(0xFF)
    assert same_state(S.unpack(*S.pack(tracked.capture(4))), before)
    assert rep.land() is None, "landed again before a capture said where"


def test_without_landing_every_capture_copies(replica, monkeypatch):
    monkeypatch.setenv("DP_SNAPSHOT_LANDING", "0")
    rep = sender(replica)
    for step, m, opt, _ in train(rep, 4, lr=3e-3):
        assert not any(lies_in_a_slot(p, rep) for p in m.parameters())
    rep.wait_acked(timeout=10)
    assert rep.stats.landed_bytes == 0


class Counter:
    """A tracked object whose state can change size (another layout for the captures after it does)."""

    def __init__(self):
        self.seen = torch.zeros(1000)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, sd):
        self.seen = sd["seen"].clone()


def test_a_capture_in_another_layout_does_not_clobber_the_state_that_lies_in_its_buffer(replica):
    """The tracked tree changes shape while the state lies in the buffer about to be captured: that buffer is
    left to the state and the capture goes into a new one; the next steps land again and the run is torch's."""
    expected = reference_states(9, lr=3e-3)
    rep = sender(replica)
    counter = Counter()
    for step, m, opt, tracked in train(rep, 9, lr=3e-3):
        if step == 1:
            tracked.add(counter=counter)
        if step == 4:  # step 5 lands in the layout of step 4's capture, and step 5's capture is laid out anew
            counter.seen = torch.ones(1)  # (smaller: in the same buffer, where the state lies)
        assert same_state(S.unpack(*S.pack(tracked.capture(step))), expected[step]), f"step {step}"
        rep.wait_acked(timeout=10)
        held = rep.local(step)
        assert same_state(S.unpack(held.meta, held.data), expected[step])
        assert same_state(held_by(replica, step), expected[step]), f"the holder's copy of step {step}"
    assert all(lies_in_a_slot(p, rep) for p in m.parameters()), "it did not land again after the new layout"



def test_a_tensor_in_a_snapshot_buffer_that_cannot_land_leaves_it_instead_of_writing_it(replica):
    """A step told of no place for a tensor that lies in a snapshot buffer (its place unknown) writes that
    tensor's new value to fresh memory: the snapshot it lies in stays as captured."""
    expected = reference_states(5, lr=3e-3)
    rep = sender(replica)
    for step, m, opt, tracked in train(rep, 4, lr=3e-3):
        pass
    rep.wait_acked(timeout=10)
    held = rep.local(4)
    before = held.data.clone()
    backward(m, 5)
    opt.landing = lambda t: None
    opt.step()
    assert torch.equal(held.data, before), "a snapshot buffer was written in place"
    assert not any(lies_in_a_slot(t, rep) for t in [*m.parameters(), *S.flatten(opt.state_dict())[1]])
    assert same_state(S.unpack(*S.pack(tracked.capture(5))), expected[5])
