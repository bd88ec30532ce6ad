"""Dedup of data parallel state: a holder keeps a peer's snapshot by reference to the identical blocks of its
own node's snapshot (a worker's shared buffer, mapped read-only) and receives only the blocks that differ.

Real sockets (a ReplicaServer in a background thread) and real shared memory; the "local worker" is this
process, so the holder maps this process's memfds as an agent maps its workers'.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from dpcommon import protocol as P
from dpcommon.checksum import CHECKSUM_BLOCK, block_digests
from dpagent import dedup
from dpagent.dedup import LocalCopies, Offer, assemble, decide
from dpstate.snapshot import packing as S
from dpstate.steps.abort import AbortSignal
from dpstate.replication.replicator import Replicator, ReplicationError
from dpstate.snapshot.shared import HEADER_BYTES, SharedBuffer
from dpstate.snapshot.state import Tracked
from helpers.fake_agents import TOKEN
from helpers.replication import data_parallel_state, replicators

pytestmark = pytest.mark.timeout(60)


def snapshot(rep: Replicator, tracked: Tracked, step: int) -> None:
    rep.submit(step, tracked.capture(step))
    rep.wait_acked(timeout=10)


def test_a_peer_sends_only_the_blocks_that_differ_and_the_copy_fetched_is_its_own(holder, peer_node, monkeypatch):
    local, peer = replicators(monkeypatch, holder, peer_node)
    state0, state1 = data_parallel_state(0), data_parallel_state(1)

    snapshot(local, state0, 5)
    snapshot(peer, state1, 5)
    mine = peer.local(5)
    blocks = -(-mine.nbytes // CHECKSUM_BLOCK)
    assert blocks >= 6
    assert peer.stats.offers == 1
    assert peer.stats.blocks_sent <= 1, peer.stats  # the per-rank tensors' block, if not in the tail (sent with the offer)
    held = holder.store.get(1, 5)
    assert held is not None and held.base is not None and held.base.step == 5
    assert holder.newest_stored(1) == 5

    other = Replicator(P.Codec(TOKEN), 2, AbortSignal())
    fetched = other.fetch(holder.replica_endpoint, 1, 5, timeout=10)  # checks the checksum
    assert fetched.meta == mine.meta and torch.equal(fetched.data, mine.data)
    tree = S.unpack(fetched.meta, fetched.data)
    assert torch.equal(tree["state"]["position"]["where"], torch.full((1000,), 1))

    # the local worker captures twice more: its ring of 2 reuses step 5's buffer, so the copy that referred
    # to it is stale and is not served (a fetch finds it missing instead of loading other bytes)
    snapshot(local, state0, 6)
    snapshot(local, state0, 7)
    with pytest.raises(ReplicationError, match="has no snapshot"):
        other.fetch(holder.replica_endpoint, 1, 5, timeout=10)


def test_an_offer_ahead_of_the_local_snapshot_waits_for_it(holder, peer_node, monkeypatch):
    local, peer = replicators(monkeypatch, holder, peer_node)
    state0, state1 = data_parallel_state(0), data_parallel_state(1)
    snapshot(local, state0, 1)
    snapshot(peer, state1, 1)
    sent = peer.stats.blocks_sent

    peer.submit(2, state1.capture(2))  # the local worker has not taken step 2 yet: the offer waits
    holder.wait(lambda: holder.server._waiting, 5, "the offer to wait")
    assert holder.newest_stored(1) == 1
    snapshot(local, state0, 2)
    peer.wait_acked(timeout=10)
    assert peer.stats.blocks_sent - sent <= 1
    assert holder.store.get(1, 2).base is not None


def test_different_state_is_sent_whole_and_fetched_intact(holder, peer_node, monkeypatch):
    local, peer = replicators(monkeypatch, holder, peer_node)
    snapshot(local, data_parallel_state(0, seed=0), 3)
    snapshot(peer, data_parallel_state(1, seed=1), 3)  # other parameters: every block differs
    mine = peer.local(3)
    assert peer.stats.blocks_sent == mine.nbytes // CHECKSUM_BLOCK  # every whole block; the tail came with the offer
    assert holder.store.get(1, 3).base is None
    fetched = Replicator(P.Codec(TOKEN), 2, AbortSignal()).fetch(holder.replica_endpoint, 1, 3, timeout=10)
    assert torch.equal(fetched.data, mine.data)


class _RankPart:
    """Another logical rank's part that a process carrying it tracks (its data position, ~1.5 MB here: whole
    blocks past the data parallel part, which a process carrying one rank fewer does not have)."""

    def __init__(self, rank: int):
        self.where = torch.full((200_000,), rank, dtype=torch.int64)

    def state_dict(self):
        return {"where": self.where}

    def load_state_dict(self, state):
        self.where.copy_(state["where"])


def carrying(ranks: tuple[int, ...]) -> Tracked:
    """Data parallel state of a process that carries `ranks` (a narrow job's), its model replicated."""
    tracked = data_parallel_state(ranks[0])
    for rank in ranks[1:]:
        tracked.add(**{f"rank{rank}": _RankPart(rank)})
    tracked.replicate(tracked.objects["model"])
    return tracked


@pytest.mark.parametrize("local_ranks, peer_ranks", [((0,), (1, 2)), ((0, 2), (1,))],
                         ids=["offer-carries-more", "holder-carries-more"])
def test_after_a_change_of_width_an_offer_takes_the_data_parallel_blocks_of_the_local_copy_at_once(
        holder, peer_node, monkeypatch, local_ranks, peer_ranks):
    """A shrink or a grow: the processes that carry other ranks than before re-capture the restore step, so the
    holder's own copy of it is laid out as the offer's only up to the end of the data parallel part. The offer
    must be settled against it at once (not wait out OFFER_WAIT_S for a copy of its very size, which never
    comes), and only the per-rank blocks be sent; so too a narrow job's next steps (nothing expected)."""
    monkeypatch.setattr(dedup, "OFFER_WAIT_S", 30.0)  # a wait sat out shows as a timeout, however busy the host
    local, peer = replicators(monkeypatch, holder, peer_node)
    here, there = carrying(local_ranks), carrying(peer_ranks)
    holder.server.expect_local(5, time.monotonic())  # the Reconfigure: this node's worker restores step 5
    for step in (5, 6):
        local.submit(step, here.capture(step), here.shared_keys)
        local.wait_acked(timeout=10)  # captured and announced (it replicates nowhere)
        sent = peer.stats.blocks_sent
        peer.submit(step, there.capture(step), there.shared_keys)
        peer.wait_acked(timeout=10)
        mine = peer.local(step)
        assert mine.plan is not None and mine.plan.shared_blocks >= 6
        per_rank_blocks = mine.digests.size - mine.plan.shared_blocks
        assert peer.stats.blocks_sent - sent <= per_rank_blocks, (step, peer.stats)
        held = holder.store.get(1, step)
        assert held is not None and held.base is not None and held.base.nbytes != mine.nbytes
        fetched = Replicator(P.Codec(TOKEN), 2, AbortSignal()).fetch(holder.replica_endpoint, 1, step, timeout=10)
        assert fetched.meta == mine.meta and torch.equal(fetched.data, mine.data)


# ----------------------------------------------------------------------------- the holder's logic alone


def announce(copies: LocalCopies, buf: SharedBuffer, step: int, nbytes: int, **change) -> str:
    digests = block_digests(buf.tensor[:nbytes].numpy())
    fields = dict(rank=0, step=step, pid=os.getpid(), fd=buf.fd, inode=buf.inode, offset=HEADER_BYTES,
                  nbytes=nbytes, writes=buf.writes)
    fields.update(change)
    return copies.announce(P.LocalSnapshot(**fields), [digests.tobytes()])


def offer(data: np.ndarray, step: int, now: float) -> Offer:
    msg = P.OfferSnapshot(rank=1, step=step, generation=0, checksum=0, nbytes=data.size)
    tail = data[data.size // CHECKSUM_BLOCK * CHECKSUM_BLOCK :].tobytes()
    return Offer(None, msg, b"", block_digests(data), data.size, deadline=now + 2.0, tail=tail)


def test_local_copies_refuse_what_is_not_a_worker_buffer_of_this_node():
    buf = SharedBuffer(3 * CHECKSUM_BLOCK)
    copies = LocalCopies(lambda: [os.getpid()])
    assert "not a worker" in announce(copies, buf, 1, 2 * CHECKSUM_BLOCK, pid=os.getppid())
    assert "inode" in announce(copies, buf, 1, 2 * CHECKSUM_BLOCK, inode=buf.inode + 1)
    assert "outside the buffer" in announce(copies, buf, 1, 2 * CHECKSUM_BLOCK, offset=2 * CHECKSUM_BLOCK)
    assert "digests" in copies.announce(P.LocalSnapshot(0, 1, os.getpid(), buf.fd, buf.inode, HEADER_BYTES,
                                                        2 * CHECKSUM_BLOCK, buf.writes), [b"12345678"])
    assert copies.find(1, 2 * CHECKSUM_BLOCK) is None
    assert announce(copies, buf, 1, 2 * CHECKSUM_BLOCK) == ""
    assert copies.find(1, 2 * CHECKSUM_BLOCK) is not None


def test_decide_asks_for_differing_blocks_and_the_tail_and_assemble_joins_them():
    nbytes = 3 * CHECKSUM_BLOCK + 100
    buf = SharedBuffer(nbytes)
    buf.begin_write()
    local_bytes = buf.tensor.numpy()
    local_bytes[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    copies = LocalCopies(lambda: [os.getpid()])
    assert announce(copies, buf, 7, nbytes) == ""

    peer = local_bytes.copy()
    peer[CHECKSUM_BLOCK + 5] ^= 1  # block 1 differs
    peer[-1] ^= 1  # and the tail
    now = 100.0
    ahead = offer(peer, 8, now)
    assert not decide(ahead, copies, now)  # the local worker is at 7: worth waiting for its 8
    assert decide(ahead, copies, now + 2.5) and ahead.copy is None and ahead.wanted == [0, 1, 2]

    same_step = offer(peer, 7, now)
    assert decide(same_step, copies, now)
    assert same_step.copy is not None and same_step.wanted == [1]  # the tail came with the offer
    blocks = P.block_views(peer)
    frames = assemble(same_step, [blocks[1]])
    assert b"".join(bytes(f) for f in frames) == peer.tobytes()
    assert "expected 1 blocks" in assemble(same_step, [blocks[1], blocks[2]])

    buf.begin_write()  # the worker writes its buffer again: the copy no longer vouches for those bytes
    assert not same_step.copy.valid()
    assert "changed meanwhile" in assemble(same_step, [blocks[1]])
    assert copies.find(7, nbytes) is None


def test_decide_takes_the_blocks_a_local_copy_of_another_size_holds_and_asks_for_the_rest():
    rng = np.random.default_rng(3)
    short, long = 2 * CHECKSUM_BLOCK + 10, 4 * CHECKSUM_BLOCK + 10
    buffers = {n: SharedBuffer(n) for n in (short, long)}
    for buf in buffers.values():
        buf.begin_write()
    buffers[short].tensor.numpy()[:] = rng.integers(0, 255, short, dtype=np.uint8)
    base = buffers[short].tensor.numpy()
    buffers[long].tensor.numpy()[: 2 * CHECKSUM_BLOCK] = base[: 2 * CHECKSUM_BLOCK]
    buffers[long].tensor.numpy()[2 * CHECKSUM_BLOCK :] = rng.integers(0, 255, long - 2 * CHECKSUM_BLOCK, dtype=np.uint8)
    for size, buf in buffers.items():
        copies = LocalCopies(lambda: [os.getpid()])
        assert announce(copies, buf, 4, size) == ""
        peer = (buffers[long] if size == short else buffers[short]).tensor.numpy().copy()
        peer[CHECKSUM_BLOCK + 1] ^= 1  # block 1 differs; block 0 is the local copy's
        held = offer(peer, 4, 0.0)
        assert decide(held, copies, 0.0) and held.copy is not None
        assert held.wanted == ([1, 2, 3] if size == short else [1])  # a short copy has no blocks 2 and 3
        frames = assemble(held, [P.block_views(peer)[i] for i in held.wanted])
        assert b"".join(bytes(f) for f in frames) == peer.tobytes()


def test_local_copies_keep_a_workers_two_newest_buffers_only():
    copies = LocalCopies(lambda: [os.getpid()])
    buffers = [SharedBuffer(CHECKSUM_BLOCK) for _ in range(3)]
    for step, buf in enumerate(buffers):
        assert announce(copies, buf, step, CHECKSUM_BLOCK) == ""
    assert [copies.find(step, CHECKSUM_BLOCK) is not None for step in range(3)] == [False, True, True]
    assert len(copies._maps) == 2  # the oldest buffer is no longer mapped
    buffers[2].begin_write()  # written again: stale, and dropped at the next announcement
    assert announce(copies, buffers[1], 1, CHECKSUM_BLOCK) == ""
    assert copies.find(2, CHECKSUM_BLOCK) is None and len(copies._maps) == 1


def test_assemble_joins_runs_of_local_blocks_into_chunks_of_at_most_chunk_bytes():
    per_chunk = P.CHUNK_BYTES // CHECKSUM_BLOCK
    nbytes = (2 * per_chunk + 3) * CHECKSUM_BLOCK + 10
    buf = SharedBuffer(nbytes)
    buf.begin_write()
    buf.tensor.numpy()[:] = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    copies = LocalCopies(lambda: [os.getpid()])
    assert announce(copies, buf, 3, nbytes) == ""
    peer = buf.tensor.numpy().copy()
    peer[(per_chunk + 1) * CHECKSUM_BLOCK] ^= 0xFF  # one block in the middle differs
    same = offer(peer, 3, 0.0)
    assert decide(same, copies, 0.0) and same.wanted == [per_chunk + 1]
    blocks = P.block_views(peer)
    frames = assemble(same, [blocks[i] for i in same.wanted])
    sizes = [memoryview(f).nbytes for f in frames]
    assert sizes == [P.CHUNK_BYTES, CHECKSUM_BLOCK, CHECKSUM_BLOCK, P.CHUNK_BYTES, CHECKSUM_BLOCK, 10]
    assert b"".join(bytes(f) for f in frames) == peer.tobytes()


@pytest.mark.slow  # random cases: ~14 s on a busy host
def test_random_differences_are_always_reassembled_to_the_peers_bytes_and_checksum():
    """Property: whatever blocks differ (none, some, all; any tail), the held frames are the peer's bytes,
    the checksum over them is the peer's, and no frame but the last breaks a checksum block."""
    from dpcommon.checksum import checksum, checksum_chunks

    rng = np.random.default_rng(7)
    copies = LocalCopies(lambda: [os.getpid()])
    for case in range(60):
        nbytes = int(rng.integers(0, 11)) * CHECKSUM_BLOCK + int(rng.integers(0, 3)) * int(rng.integers(1, 5000))
        buf = SharedBuffer(max(nbytes, 1))
        buf.begin_write()
        local_bytes = buf.tensor.numpy()[:nbytes]
        local_bytes[:] = rng.integers(0, 255, nbytes, dtype=np.uint8)
        assert announce(copies, buf, case, nbytes) == ""
        peer = local_bytes.copy()
        for block in range(-(-nbytes // CHECKSUM_BLOCK)):
            if rng.random() < 0.3:
                at = block * CHECKSUM_BLOCK + int(rng.integers(0, min(CHECKSUM_BLOCK, nbytes - block * CHECKSUM_BLOCK)))
                peer[at] ^= int(rng.integers(1, 256))
        held = offer(peer, case, 0.0)
        assert decide(held, copies, 0.0)
        frames = assemble(held, [P.block_views(peer)[i] for i in held.wanted])
        assert b"".join(bytes(f) for f in frames) == peer.tobytes(), case
        assert checksum_chunks(b"meta", [memoryview(f) for f in frames]) == checksum(b"meta", peer), case


# ----------------------------------------------------------------------------- a real job


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_replicates_only_what_differs_and_recovers_bitwise_from_deduplicated_copies(procs, tmp_path):
    """2 nodes + a spare, ~12 MB of state (12 blocks): the holders receive about one block per snapshot,
    and a node killed mid-run is restored from its holder's deduplicated copy to the very same result."""
    from helpers.e2e import dprun

    bigger = ("--n-layer", "4", "--n-embd", "128", "--n-head", "4")
    # the failure-free run, without the spare the killed run needs (an idle spare changes nothing trained)
    reference = dprun(procs, tmp_path, "reference", "--nnodes", "2", "--spares", "0", steps=30, train_args=bigger)
    assert reference.returncode == 0, reference.stderr[-3000:]
    profile = tmp_path / "profile"
    run = dprun(procs, tmp_path, "killed", "--nnodes", "2", "--spares", "1", "--inject", "kill-node:1@step=15",
                steps=30, train_args=bigger, env={**os.environ, "DP_SNAPSHOT_PROFILE": str(profile)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.named("recovery_complete")) == 1
    assert run.summary["params_sha256"] == reference.summary["params_sha256"], "recovered run diverged"

    import json

    profiles = [json.loads(p.read_text()) for p in tmp_path.glob("profile.rank*.json")]
    assert {p["rank"] for p in profiles} == {0, 1}  # the survivor and the spare that took rank 1 (node 1: killed)
    for prof in profiles:
        blocks = -(-prof["bytes"] // prof["captures"] // CHECKSUM_BLOCK)
        assert blocks >= 10 and prof["offers"] >= 10, prof
        # a tail (and the RNG's block) per snapshot, plus a few whole ones: the first after the job starts or
        # a new holder joins can come before that holder's own node has a snapshot of the step to match
        assert prof["blocks_sent"] <= 2 * prof["offers"] + 4 * blocks, prof
        assert prof["blocks_sent"] < 0.4 * prof["offers"] * blocks, prof


def test_a_node_restoring_a_step_makes_offers_of_it_wait_even_before_its_first_snapshot():
    copies = LocalCopies(lambda: [os.getpid()])  # a promoted spare's node: no snapshot announced yet
    data = np.zeros(2 * CHECKSUM_BLOCK, dtype=np.uint8)
    assert decide(offer(data, 5, 0.0), copies, 0.0)  # nothing coming: asked for whole at once
    copies.expect(5, until=10.0)  # the Reconfigure: its worker restores step 5
    assert not decide(offer(data, 5, 0.0), copies, 0.0)
    assert decide(offer(data, 6, 0.0), copies, 0.0)  # another step: not coming
    assert decide(offer(data, 5, 0.0), copies, 2.5)  # the offer's own wait is over
    assert decide(offer(data, 5, 11.0), copies, 11.0)  # the restore is long past
