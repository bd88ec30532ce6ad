"""dpstate Replicators and state for them to snapshot, for tests that replicate to FakeAgents replica stores in
this process: a small model's state, data parallel state (alike on every rank), a holder's worker and its peer."""

from __future__ import annotations

import torch

from dpcommon import protocol as P
from dpstate.steps.abort import AbortSignal
from dpstate.replication.replicator import Replicator
from dpstate.snapshot.state import Tracked
from helpers.fake_agents import TOKEN


def state(seed: int = 0):
    """A small model and its AdamW after one step, and a Tracked of both: (model, optimizer, tracked)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt)
    return model, opt, tracked


def replicator(rank: int = 1, abort: AbortSignal | None = None) -> Replicator:
    """A Replicator of `rank` with the tests' token; configure() points it at a replica store."""
    return Replicator(P.Codec(TOKEN), rank, abort or AbortSignal())


def data_parallel_state(rank: int, seed: int = 0) -> Tracked:
    """~6 MB of parameters + AdamW state, the same on every rank for the same seed, plus a per-rank tensor
    (as the RNG state and the data position differ between data parallel ranks)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt, position=_Position(rank))
    return tracked


class _Position:
    def __init__(self, rank: int):
        self.where = torch.full((1000,), rank, dtype=torch.int64)

    def state_dict(self):
        return {"where": self.where}

    def load_state_dict(self, state):
        self.where.copy_(state["where"])


def sharing_replicator(monkeypatch, rank: int, local_store: str) -> Replicator:
    """A Replicator of `rank` whose snapshot buffers are shared with its node's replica store at `local_store`
    (DP_LOCAL_REPLICA, as an agent tells its workers)."""
    monkeypatch.setenv("DP_LOCAL_REPLICA", local_store)
    rep = Replicator(P.Codec(TOKEN), rank, AbortSignal())
    assert rep.share, "shared snapshot buffers need memfd_create and /proc (Linux)"
    return rep


def replicators(monkeypatch, holder, peer_node) -> tuple[Replicator, Replicator]:
    """The holder's own worker (rank 0: its snapshots stay on its node, announced to it) and a peer (rank 1,
    on peer_node) that replicates to the holder."""
    local = sharing_replicator(monkeypatch, 0, holder.replica_endpoint)
    local.configure(0, [], 0)
    peer = sharing_replicator(monkeypatch, 1, peer_node.replica_endpoint)
    peer.configure(0, holder.replica_endpoint, 1)
    return local, peer
