"""DataParallel: an nn.Module proxy over a torch DDP that is rebuilt for every generation's process group.

Gradients go through an abortable comm hook: an abort completes its pending futures with an exception. The
last bucket of a backward first passes the job's snapshot gate (see Job._gate): no rank's optimizer step S+1
runs before every rank's snapshot of step S is acked.

Bitwise identity: the hook divides by the world size and then sums. For two ranks an all-reduce is exact
(a + b == b + a). For three or more, Gloo's ring all-reduce sums an element in an order that depends on
its offset in the bucket, and DDP rebuilds its buckets after the first iteration of every new DDP, so a
recovered run would see different bucket layouts than a failure-free one. With deterministic=True (the
default) such worlds use all-gather + a sum in rank order instead: exact whatever the layout, at the
cost of receiving (W-1) buckets per rank instead of about 2 (W-1)/W of one (a ring all-reduce).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dpstate.steps.abort import AbortSignal
from dpstate.steps.watch import WATCHER

_SYNC_BUFFERS_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AbortableHook:
    """DDP comm hook state: issues the reduction async and completes its own Future, or fails it on abort.
    The backend future is polled by the watcher thread (see watch.py), never given a Python callback."""

    def __init__(self, abort: AbortSignal, group: Any, deterministic: bool, gate: Callable[[], None] | None = None):
        self.abort = abort
        self.gate = gate  # called before the last bucket's collective: waits (abortably) for the snapshot acks
        self.group = group
        self.world = dist.get_world_size(group)
        self.ordered = deterministic and self.world > 2
        self.backward_seen = False  # a backward ran: DDP rebuilds its buckets in the next forward
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[torch.futures.Future, int | None]] = {}  # id -> (our future, watch token)
        self._token = abort.add_callback(self._fail_pending)

    def close(self) -> None:
        self.abort.remove_callback(self._token)
        self._fail_pending()

    def _finish(self, fut: torch.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._pending.pop(id(fut), None)
        if entry is None:
            return
        if entry[1] is not None:
            WATCHER.unwatch(entry[1])  # an abandoned backend op stops being polled
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def _fail_pending(self) -> None:
        with self._lock:
            pending = [fut for fut, _ in self._pending.values()]
        for fut in pending:
            self._finish(fut, error=self.abort.error())

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.backward_seen = True
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._pending[id(fut)] = (fut, None)
        if self.abort.is_set():
            self._finish(fut, error=self.abort.error())
            return fut
        tensor = bucket.buffer()
        tensor.div_(self.world)
        try:
            if self.gate is not None and bucket.is_last():
                self.gate()
            if self.ordered:
                gathered = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
                work = all_gather_flat(gathered, tensor, group=self.group, async_op=True)
                done = lambda: _ordered_sum(gathered.view(self.world, -1), tensor)  # noqa: E731
            else:
                work = dist.all_reduce(tensor, group=self.group, async_op=True)
                done = lambda: tensor  # noqa: E731
        except Exception as exc:  # the group is already broken, an abort came at the gate, replication failed
            self._finish(fut, error=exc)
            return fut

        def complete(result: torch.futures.Future) -> None:  # in the watcher thread, result is done
            try:
                result.wait()
                value = done()
            except Exception as exc:
                self._finish(fut, error=exc)
            else:
                self._finish(fut, value=value)

        with self._lock:
            if id(fut) not in self._pending:  # aborted meanwhile
                return fut
            token = WATCHER.watch(work.get_future(), complete)
            self._pending[id(fut)] = (fut, token)
        return fut


def _hook(state, bucket):  # unannotated: DDP checks annotations, which are strings under __future__
    return state(bucket)


def _ordered_sum(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        out.add_(rows[r])
    return out


class DataParallel(nn.Module):
    """ddp_model = job.data_parallel(model): call it like the model; DDP is (re)built lazily per generation."""

    # Set with object.__setattr__, past nn.Module's (which would register a DDP as a submodule); declared so
    # that their types are known rather than nn.Module.__getattr__'s Tensor | Module.
    _abort: AbortSignal
    _gate: Callable[[], None] | None
    _deterministic: bool
    _ddp_kwargs: dict[str, Any]
    _ddp: nn.parallel.DistributedDataParallel | None  # None until first used in a generation
    _hook_state: AbortableHook | None  # the comm hook state of _ddp
    narrow: bool  # the job runs narrow: the module alone, its gradients reduced by dpstate.groups.narrow

    def __init__(self, module: nn.Module, abort: AbortSignal, deterministic: bool = True,
                 gate: Callable[[], None] | None = None, **ddp_kwargs: Any):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_abort", abort)
        object.__setattr__(self, "_gate", gate)
        object.__setattr__(self, "_deterministic", deterministic)
        # DDP's own collectives outside the hook (buffer broadcast each forward, init sync) would not be
        # abortable; dpstate syncs parameters itself on a fresh start and restores them on recovery.
        if "broadcast_buffers" not in ddp_kwargs:
            ddp_kwargs.setdefault(_SYNC_BUFFERS_ARG, False)
        ddp_kwargs["init_sync"] = False
        object.__setattr__(self, "_ddp_kwargs", ddp_kwargs)
        object.__setattr__(self, "_ddp", None)
        object.__setattr__(self, "_hook_state", None)
        self.narrow = False
        # A survivor learns of a failure while it computes; it stops at the next gradient instead of running
        # the rest of a step whose result is abandoned anyway (the recovery waits for it to join the group).
        # Not on a Stop: a script may still evaluate after its last step while the job ends.
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _param: abort.check_superseded())

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel:
        """The DDP of the current generation (built on first use)."""
        ddp = self._ddp
        if ddp is None:
            group = dist.group.WORLD
            ddp = nn.parallel.DistributedDataParallel(self.module, process_group=group, **self._ddp_kwargs)
            state = AbortableHook(self._abort, group, self._deterministic, self._gate)
            ddp.register_comm_hook(state, _hook)
            object.__setattr__(self, "_ddp", ddp)
            object.__setattr__(self, "_hook_state", state)
        return ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._abort.check_superseded()
        if self.narrow:
            return self.module(*args, **kwargs)
        ddp = self.ddp
        state = self._hook_state
        assert state is not None  # built along with the DDP
        if not ddp._has_rebuilt_buckets and torch.is_grad_enabled() and state.backward_seen:
            self._rebuild_buckets(ddp)
        return ddp(*args, **kwargs)

    def _rebuild_buckets(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """In the forward after its first backward, DDP rebuilds its buckets with a blocking broadcast that
        no abort could release. So first meet every rank at an abortable barrier, then rebuild at once
        (DDP's own call in forward then finds nothing to do): only a peer that freezes in the microseconds
        between the two can still hold us, until the collective timeout. (Running the rebuild in a helper
        thread instead would be abortable, but a helper still blocked in C++ when the interpreter exits
        makes the process abort: "terminate called without an active exception".)"""
        state = self._hook_state
        assert state is not None  # forward() built it along with `ddp`
        self._abort.wait_future(dist.barrier(group=state.group, async_op=True).get_future())
        if ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True

    def no_sync(self):
        return contextlib.nullcontext() if self.narrow else self.ddp.no_sync()

    def drop(self) -> None:
        """Forget the DDP of the old generation: its hooks leave the parameters, pending futures fail."""
        ddp, state = self._ddp, self._hook_state
        object.__setattr__(self, "_ddp", None)
        object.__setattr__(self, "_hook_state", None)
        if state is not None:
            state.close()
        if ddp is not None:
            try:
                ddp._remove_autograd_hooks()
            except Exception:
                pass


def sync_from_rank0(proxies: list[DataParallel], abort: AbortSignal) -> None:
    """A fresh start: every data parallel module takes rank 0's parameters and buffers (one abortable
    broadcast per dtype and device)."""
    tensors = [t for p in proxies for t in itertools.chain(p.module.parameters(), p.module.buffers())]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            abort.wait_future(dist.broadcast(flat, 0, async_op=True).get_future())
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
