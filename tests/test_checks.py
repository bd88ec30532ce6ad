"""Check plans: data parallel state is laid out first and only sampled by the checksum; a holder keeps the
unchecked blocks by reference to its own node's copy, compares the sampled ones, and a divergence found ends
the trust (the worker checksums every block from then on).

Pure logic first (plans, digests, layout, the holder's decision, a property over random plans and
differences), then real sockets and shared memory: a holder whose "local worker" is this process (test_dedup).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dpcommon import protocol as P
from dpcommon.checksum import CHECKSUM_BLOCK, CheckPlan, block_digests, checksum, checksum_chunks
from dpagent.dedup import LocalCopies, Offer, assemble, decide
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.snapshot.checks import CheckPlanner, check_every_from_env, replicated_keys, tensor_key
from dpstate.replication.replicator import Replicator
from dpstate.snapshot.shared import HEADER_BYTES, SharedBuffer
from dpstate.snapshot.state import Tracked
from helpers.e2e import wait_for
from helpers.fake_agents import TOKEN
from helpers.replication import data_parallel_state, replicators

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- plans and digests


def test_a_plan_samples_one_shared_block_in_every_and_checks_all_the_rest():
    plan = CheckPlan(shared_blocks=10, shared_key=3, every=4, phase=1)
    unchecked = plan.unchecked(13)
    assert np.flatnonzero(~unchecked).tolist() == [1, 5, 9, 10, 11, 12]
    assert CheckPlan(10, 3, 1, 0).unchecked(13).sum() == 0  # every=1: all checked ("full")
    assert plan.unchecked(4).tolist() == [True, False, True, True]  # fewer blocks than shared: clipped


def test_phases_follow_the_step_and_visit_every_phase_even_at_an_interval():
    for interval in (1, 2, 4, 8):
        phases = {CheckPlan.for_step(64, 1, 8, step).phase for step in range(interval, 65 * interval, interval)}
        assert phases == set(range(8)), interval
    assert CheckPlan.for_step(64, 1, 8, 12) == CheckPlan.for_step(64, 1, 8, 12)  # every rank alike


def test_digests_leave_unchecked_blocks_zero_and_the_checksum_reads_the_plan_from_the_meta():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, 9 * CHECKSUM_BLOCK + 123, dtype=np.uint8)
    plan = CheckPlan(shared_blocks=6, shared_key=5, every=3, phase=2)
    digests = block_digests(data, plan)
    full = block_digests(data)
    checked = ~plan.unchecked(9)
    assert (digests[checked] == full[checked]).all() and (digests[~checked] == 0).all()
    meta = S.encode_meta(["v", 1], [], data.size, {}, plan)
    assert CheckPlan.from_meta(meta) == plan
    assert checksum(meta, data) == checksum(meta, data, plan) != checksum(meta, data, None)
    # chunked as a holder keeps it (4 MiB frames), the plan applies to the whole data's block indexes
    assert checksum_chunks(meta, P.chunk_views(data)) == checksum(meta, data)
    # an unchecked block may change (that is the trust); a checked one may not
    changed = data.copy()
    changed[0] ^= 1
    assert checksum(meta, changed) == checksum(meta, data)
    changed[2 * CHECKSUM_BLOCK] ^= 1
    assert checksum(meta, changed) != checksum(meta, data)
    assert checksum(b"not json", data) == checksum(b"not json", data, None)  # no plan: every block


@pytest.mark.parametrize("doc", [{"shared_blocks": 1}, {"shared_blocks": -1, "shared_key": 1, "every": 1, "phase": 0},
                                 {"shared_blocks": 1, "shared_key": 1, "every": 2, "phase": 2},
                                 {"shared_blocks": 1, "shared_key": 1, "every": True, "phase": 0}, ["x"]])
def test_malformed_plans_are_refused(doc):
    with pytest.raises(ValueError, match="malformed check plan"):
        CheckPlan.from_json(doc)


def test_check_every_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("DP_SNAPSHOT_CHECK", raising=False)
    assert check_every_from_env() == 8
    monkeypatch.setenv("DP_SNAPSHOT_CHECK", "full")
    assert check_every_from_env() == 1
    monkeypatch.setenv("DP_SNAPSHOT_CHECK", "3")
    assert check_every_from_env() == 3
    for bad in ("0", "-2", "some"):
        monkeypatch.setenv("DP_SNAPSHOT_CHECK", bad)
        with pytest.raises(ValueError, match="DP_SNAPSHOT_CHECK"):
            check_every_from_env()


# ----------------------------------------------------------------------------- layout


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def test_shared_tensors_come_first_padded_to_a_block_and_the_tree_round_trips():
    model, opt = trained()
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt)
    tracked.replicate(model)
    tree = tracked.capture(3)
    skeleton, tensors = S.flatten(tree)
    keys = tracked.shared_keys()
    assert keys == replicated_keys([model], [opt])
    specs, nbytes, shared_nbytes, flags = CheckPlanner(8).layout(tensors, tracked.shared_keys)
    shared_bytes = sum(s.nbytes for s, f in zip(specs, flags) if f)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert shared_bytes >= 3 * param_bytes  # parameters, exp_avg, exp_avg_sq (and the step counters)
    assert shared_nbytes % CHECKSUM_BLOCK == 0 and shared_nbytes >= shared_bytes
    assert all((s.offset < shared_nbytes) == f for s, f in zip(specs, flags) if s.nbytes)
    assert not any(flags[i] for i, t in enumerate(tensors) if t.dtype == torch.uint8)  # the RNG state is per rank
    data = torch.zeros(nbytes, dtype=torch.uint8)
    S.copy_into(tensors, specs, data)
    back = S.unpack(S.encode_meta(skeleton, specs, nbytes), data)
    assert all(torch.equal(back["state"]["model"][k], v) for k, v in model.state_dict().items())
    moved = list(specs)
    moved[0] = S.TensorSpec(moved[0].dtype, moved[0].shape, moved[0].offset + 64, moved[0].nbytes)
    assert S.shared_key(specs, flags) != S.shared_key(moved, flags)  # another layout: another fingerprint


def test_tensor_keys_identify_state_dict_tensors_by_their_bytes():
    model, _ = trained()
    weight = model[0].weight
    assert tensor_key(model.state_dict()["0.weight"]) == tensor_key(weight)
    assert tensor_key(weight[1:]) != tensor_key(weight)


# ----------------------------------------------------------------------------- the holder's decision


def local_copy(data: np.ndarray, step: int, plan: CheckPlan | None) -> tuple[LocalCopies, SharedBuffer]:
    buf = SharedBuffer(max(data.size, 1))
    buf.begin_write()
    buf.tensor.numpy()[: data.size] = data
    copies = LocalCopies(lambda: [os.getpid()])
    msg = P.LocalSnapshot(rank=0, step=step, pid=os.getpid(), fd=buf.fd, inode=buf.inode, offset=HEADER_BYTES,
                          nbytes=data.size, writes=buf.writes, checks=plan.as_json() if plan else {})
    assert copies.announce(msg, [block_digests(data, plan).tobytes()]) == ""
    return copies, buf


def offer_of(data: np.ndarray, step: int, plan: CheckPlan | None) -> Offer:
    msg = P.OfferSnapshot(rank=1, step=step, generation=0, checksum=0, nbytes=data.size,
                          checks=plan.as_json() if plan else {})
    tail = data[data.size // CHECKSUM_BLOCK * CHECKSUM_BLOCK :].tobytes()
    return Offer(None, msg, b"", block_digests(data, plan), data.size, deadline=2.0, plan=plan, tail=tail)


def test_trusted_blocks_are_kept_by_reference_and_a_sampled_difference_ends_the_trust():
    rng = np.random.default_rng(1)
    ours = rng.integers(0, 255, 8 * CHECKSUM_BLOCK + 10, dtype=np.uint8)
    plan = CheckPlan(shared_blocks=6, shared_key=9, every=3, phase=0)  # checks shared blocks 0 and 3
    copies, _buf = local_copy(ours, 4, plan)
    peer = ours.copy()
    peer[6 * CHECKSUM_BLOCK] ^= 1  # a per-rank block differs, as the RNG state's does
    peer[1 * CHECKSUM_BLOCK] ^= 1  # an unchecked shared block differs: not seen in this snapshot
    same = offer_of(peer, 4, plan)
    assert decide(same, copies, 0.0)
    assert same.wanted == [6] and same.differs == []  # the per-rank block (the tail came with the offer)

    peer[3 * CHECKSUM_BLOCK] ^= 1  # a sampled one differs too: the ranks diverged
    diverged = offer_of(peer, 4, plan)
    assert decide(diverged, copies, 0.0)
    assert diverged.differs == [3] and diverged.wanted == [1, 2, 3, 4, 5, 6]
    frames = assemble(diverged, [P.block_views(peer)[i] for i in diverged.wanted])
    assert b"".join(bytes(f) for f in frames) == peer.tobytes()  # the peer's own bytes, all of them


def test_unchecked_blocks_are_asked_for_unless_both_lay_out_the_shared_state_alike():
    data = np.random.default_rng(2).integers(0, 255, 4 * CHECKSUM_BLOCK, dtype=np.uint8)
    plan = CheckPlan(shared_blocks=4, shared_key=9, every=4, phase=0)
    copies, _buf = local_copy(data, 1, plan)
    for other in (CheckPlan(4, 11, 4, 0), CheckPlan(3, 9, 4, 0), None):  # another layout, or none
        held = offer_of(data, 1, plan)
        copies_other, _b = local_copy(data, 1, other)
        assert decide(held, copies_other, 0.0) and held.wanted == [1, 2, 3], other
    full_local, _b = local_copy(data, 1, CheckPlan(4, 9, 1, 0))  # the local rank checks everything (diverged)
    held = offer_of(data, 1, plan)
    assert decide(held, full_local, 0.0) and held.wanted == [] and held.differs == []
    sampled_local, _b = local_copy(data, 1, CheckPlan(4, 9, 4, 1))  # sampled at another phase: can't compare
    held = offer_of(data, 1, CheckPlan(4, 9, 1, 0))
    assert decide(held, sampled_local, 0.0) and held.wanted == [0, 2, 3]


@pytest.mark.slow  # 80 random cases: ~14 s on a busy host
def test_random_plans_and_differences_give_the_peers_checksum_and_its_checked_bytes():
    """Property: whatever the plans and the differences, the held frames have the peer's checksum (under its
    plan), hold the peer's bytes in every block the peer digested, and hold all of its bytes once a
    difference was seen in a digested shared block."""
    rng = np.random.default_rng(3)
    for case in range(80):
        nblocks = int(rng.integers(0, 9))
        nbytes = nblocks * CHECKSUM_BLOCK + int(rng.integers(0, 3000))
        ours = rng.integers(0, 255, nbytes, dtype=np.uint8)
        shared = int(rng.integers(0, nblocks + 1))
        key = int(rng.choice([5, 7]))

        def plan() -> CheckPlan | None:
            if rng.random() < 0.2:
                return None
            every = int(rng.integers(1, 4))
            return CheckPlan(shared, key if rng.random() < 0.8 else 3, every, int(rng.integers(0, every)))

        local_plan, peer_plan = plan(), plan()
        copies, _buf = local_copy(ours, case, local_plan)
        peer = ours.copy()
        for block in range(-(-nbytes // CHECKSUM_BLOCK)):
            if rng.random() < 0.25:
                at = block * CHECKSUM_BLOCK + int(rng.integers(0, min(CHECKSUM_BLOCK, nbytes - block * CHECKSUM_BLOCK)))
                peer[at] ^= int(rng.integers(1, 256))
        held = offer_of(peer, case, peer_plan)
        assert decide(held, copies, 0.0)
        frames = assemble(held, [P.block_views(peer)[i] for i in held.wanted])
        got = np.frombuffer(b"".join(bytes(f) for f in frames), dtype=np.uint8)
        meta = S.encode_meta(["v", case], [], nbytes, {}, peer_plan)
        assert checksum_chunks(meta, [memoryview(f) for f in frames]) == checksum(meta, peer), case
        checked = ~peer_plan.unchecked(nblocks) if peer_plan else np.ones(nblocks, dtype=bool)
        for i in np.flatnonzero(checked):
            assert (got[i * CHECKSUM_BLOCK : (i + 1) * CHECKSUM_BLOCK]
                    == peer[i * CHECKSUM_BLOCK : (i + 1) * CHECKSUM_BLOCK]).all(), case
        assert (got[nblocks * CHECKSUM_BLOCK :] == peer[nblocks * CHECKSUM_BLOCK :]).all(), case  # the tail
        if held.differs:
            assert (got == peer).all(), case


# ----------------------------------------------------------------------------- real sockets


def data_parallel(rank: int) -> Tracked:
    """test_dedup's ~6 MB of data parallel state and per-rank position, the model declared data parallel."""
    tracked = data_parallel_state(rank)
    tracked.replicate(tracked.objects["model"])
    return tracked


def shared_snapshot(rep: Replicator, tracked: Tracked, step: int) -> None:
    rep.submit(step, tracked.capture(step), tracked.shared_keys)
    rep.wait_acked(timeout=10)


def own_snapshot(holder, rep: Replicator, tracked: Tracked, step: int) -> None:
    """shared_snapshot by the holder's own worker, and its announce taken in by the holder: the peer's offer is
    then compared at once, where it would otherwise wait up to OFFER_WAIT_S for it (which a loaded host ran past)."""
    shared_snapshot(rep, tracked, step)

    def taken_in() -> bool:
        try:
            return bool(holder.server.local.of_step(step))
        except RuntimeError:  # (the holder's thread changed its copies meanwhile: asked again)
            return False

    wait_for(taken_in, 10, f"the holder to take in its own worker's snapshot of step {step}")


def fetch(endpoint: str, rank: int, step: int):
    return Replicator(P.Codec(TOKEN), 2, AbortSignal()).fetch(endpoint, rank, step, timeout=10)


def test_a_data_parallel_peer_sends_only_its_tail_and_a_divergence_is_caught_and_ends_the_trust(
        holder, peer_node, monkeypatch, capfd, caplog):
    monkeypatch.setenv("DP_SNAPSHOT_CHECK", "4")
    local, peer = replicators(monkeypatch, holder, peer_node)
    reported = []  # what the session sends its controller (protocol.Diverged)
    peer.on_divergence = lambda *found: reported.append(found)
    ours, theirs = data_parallel(0), data_parallel(1)

    own_snapshot(holder, local, ours, 1)
    shared_snapshot(peer, theirs, 1)
    mine = peer.local(1)
    assert mine.plan is not None and mine.plan.every == 4 and mine.plan.shared_blocks >= 6
    assert peer.stats.blocks_sent == 0, peer.stats  # the per-rank part lies in the tail, sent with the offer
    assert (mine.digests == 0).sum() >= mine.plan.shared_blocks - 2  # most shared blocks were not digested
    fetched = fetch(holder.replica_endpoint, 1, 1)  # checks the checksum under the plan
    assert torch.equal(fetched.data, mine.data)
    assert torch.equal(S.unpack(fetched.meta, fetched.data)["state"]["position"]["where"], torch.full((1000,), 1))

    # the peer's parameters drift apart in one block: unseen while the plan leaves that block unchecked...
    weight = theirs.objects["model"].weight
    with torch.no_grad():
        weight.view(-1)[0] += 1.0
    tensors, flags = _flat(theirs)
    specs = S.layout_shared(tensors, flags)[0]
    block = next(s.offset for s, t in zip(specs, tensors) if tensor_key(t) == tensor_key(weight)) // CHECKSUM_BLOCK

    def sampled(step: int) -> bool:
        return not CheckPlan.for_step(mine.plan.shared_blocks, 1, 4, step).unchecked(block + 1)[block]

    unseen = next(s for s in range(2, 200) if not sampled(s))
    seen = next(s for s in range(unseen + 1, 200) if sampled(s))
    own_snapshot(holder, local, ours, unseen)
    shared_snapshot(peer, theirs, unseen)
    assert peer.checks.every == 4 and holder.store.get(1, unseen).base is not None
    # ... and caught at the first step whose plan samples it: the holder asks for every shared block
    own_snapshot(holder, local, ours, seen)
    sent = peer.stats.blocks_sent
    shared_snapshot(peer, theirs, seen)
    assert peer.checks.every == 1 and peer.checks.diverged
    plan = peer.local(seen).plan  # taken while still sampling: every shared block it left unchecked, and the one
    assert peer.stats.blocks_sent - sent == plan.unchecked(plan.shared_blocks).sum() + 1  # that differs, is sent
    assert "differ from a data parallel peer's" in capfd.readouterr().err
    assert [(rank, step) for rank, step, _ in reported] == [(1, seen)] and block in reported[0][2]
    assert torch.equal(fetch(holder.replica_endpoint, 1, seen).data, peer.local(seen).data)
    # from now on every block is checksummed, so the holder trusts none of it: what its own rank did not
    # digest (it still samples) is sent, the rest compared, and the copy held is the peer's own every time
    own_snapshot(holder, local, ours, seen + 1)
    shared_snapshot(peer, theirs, seen + 1)
    assert peer.local(seen + 1).plan.every == 1 and (peer.local(seen + 1).digests != 0).all()
    assert torch.equal(fetch(holder.replica_endpoint, 1, seen + 1).data, peer.local(seen + 1).data)
    for step in range(seen + 2, seen + 5):  # the holder says the rank's difference once, not at every snapshot
        own_snapshot(holder, local, ours, step)
        shared_snapshot(peer, theirs, step)
    said = [r for r in caplog.records if "differ from this node's copy" in r.getMessage()]
    assert len(said) == 1 and "(1 snapshot(s) of it so far)" in said[0].getMessage(), [r.getMessage() for r in said]
    assert len(reported) == 1, "reported to the controller once too"


def _flat(tracked: Tracked):
    """(tensors, shared flags) of a capture, as the replicator lays it out."""
    _, tensors = S.flatten(tracked.capture(0))
    keys = tracked.shared_keys()
    return tensors, [tensor_key(t) in keys for t in tensors]
