"""Where an optimizer step writes the state it makes (dpstate.snapshot.optim.AdamW): into a snapshot buffer, at the
place the next capture would copy each tensor to, so that the capture finds it there and copies nothing.

The previous step's state stays untouched in the other buffer as its snapshot: the buffers take turns, as the
capture's ring did. A buffer that holds a snapshot still needed, or that the replication thread works on, is
never written; a tensor that cannot land (its place unknown, CUDA) stays where it is or goes back home.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from . import packing as S
from dpstate.replication.fetch import Slot


def enabled_by_env() -> bool:
    """DP_SNAPSHOT_LANDING=0 turns landing off (every snapshot is a copy, as with any other optimizer)."""
    return os.environ.get("DP_SNAPSHOT_LANDING", "1").strip().lower() not in ("0", "off", "false", "no")


class Landing:
    """Bookkeeping for one Replicator (called under its lock): the places of the newest capture's tensors,
    and which slot the next optimizer step writes into."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.specs: list[S.TensorSpec] | None = None  # the newest capture's layout
        self.nbytes = 0
        self._offset_of: dict[int, int] = {}  # data_ptr of each tensor the newest capture took -> its offset
        self._spec_at: dict[int, S.TensorSpec] = {}  # offset -> spec
        # (buffer address, size) -> {offset: the view of that buffer a tensor at offset lands in}, for the
        # current layout: made once per buffer and layout, not per tensor and step (~3 ms a step beside training)
        self._views: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def record(self, tensors: list[torch.Tensor], specs: list[S.TensorSpec], nbytes: int) -> None:
        """A capture of these tensors with this layout just finished: the next steps land them in its places."""
        if not self.enabled:
            return
        if specs != self.specs:
            self._spec_at, self._views = {s.offset: s for s in specs if s.nbytes}, {}
        self.specs, self.nbytes = specs, nbytes
        self._offset_of = {t.data_ptr(): s.offset for t, s in zip(tensors, specs) if t.is_cpu and s.nbytes}

    def reset(self) -> None:
        """Forget the places (a reconfiguration: the state went home and is restored; the next capture says)."""
        self.specs, self._offset_of, self._spec_at, self._views = None, {}, {}, {}

    def choose(self, slots: list[Slot], in_use: list[Slot], share: bool) -> Slot | None:
        """The slot the next optimizer step writes into: the one the state already lies in while it holds no
        snapshot, else the one whose snapshot is superseded (never one in use, never the newest snapshot).
        It is made ready for the newest capture's layout (its write counted: its old snapshot is gone)."""
        if not self.enabled or self.specs is None:
            return None
        free = [s for s in slots if not any(s is u for u in in_use)]
        newest = max((s.step for s in slots), default=-1)
        target = next((s for s in free if s.live and s.step < 0 and s.layout == self.specs), None)
        if target is None:
            spent = [s for s in free if not s.live and (s.step < newest or s.step < 0)]
            if not spent:
                return None
            target = min(spent, key=lambda s: s.step)
            target.reserve(self.nbytes, False, share)
            target.prepare_layout(self.specs, self.nbytes)
        for s in slots:
            s.live = s is target
        return target

    def destination(self, target: Slot, slots: list[Slot]) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """For a tensor of the state: the view of `target` it lands in (itself where it lies there already), or
        None where it cannot land. Its place: where it lies in a slot, else where the newest capture put it."""
        spans = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel())
                 for s in slots if s.buffer.numel() and s.layout == self.specs]
        base, end = target.buffer.data_ptr(), target.buffer.data_ptr() + target.buffer.numel()
        views = self._views_of(target.buffer, slots)
        taken: set[int] = set()  # each place is handed out once per step

        def where(t: torch.Tensor) -> torch.Tensor | None:
            ptr = t.data_ptr()
            if base <= ptr < end:
                taken.add(ptr - base)
                return t  # already there: written in place
            offset = next((ptr - lo for lo, hi in spans if lo <= ptr < hi), None)
            if offset is None:
                offset = self._offset_of.get(ptr)
            view = views.get(offset) if offset is not None else None
            if (offset is None or view is None or offset in taken or not t.is_cpu or not t.is_contiguous()
                    or t.dtype != view.dtype or t.shape != view.shape):
                return None
            taken.add(offset)
            return view

        return where

    def _views_of(self, buffer: torch.Tensor, slots: list[Slot]) -> dict[int, torch.Tensor]:
        """{offset: view} of `buffer` for each tensor of the newest capture's layout that fits it; made once per
        buffer and layout (those of buffers the slots no longer hold are dropped: they keep memory alive)."""
        held = {(s.buffer.data_ptr(), s.buffer.numel()) for s in slots}
        self._views = {key: views for key, views in self._views.items() if key in held}
        key = (buffer.data_ptr(), buffer.numel())
        if key not in self._views:
            self._views[key] = {
                offset: buffer[offset : offset + spec.nbytes].view(S.dtype_of(spec.dtype)).view(spec.shape)
                for offset, spec in self._spec_at.items() if offset + spec.nbytes <= buffer.numel()}
        return self._views[key]
