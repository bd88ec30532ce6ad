"""Parts: what job.parallelize() returns, the model, optimizer and pipeline schedule that build(mesh) makes anew
on every generation's DeviceMesh; the parts of a generation that ended are retired, so that using them raises.

Nothing of torch's parallelism can be re-pointed at new groups (fully_shard and parallelize_module apply once),
and a kept wrapper trains on quietly over old connections or binds to a new group by name (DESIGN.md): so a
retired module's forward, optimizer's step, schedule's step and mesh raise StalePartsError instead.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .mesh import MeshLayout

Build = Callable[[Any], Any]  # build(mesh) -> dict of parts, or (model, optimizer[, schedule])
_TUPLE_NAMES = ("model", "optimizer", "schedule")


class StalePartsError(RuntimeError):
    """A part built for a generation that ended was used: read it from the Parts object in each step."""


def _stale_message(name: str, generation: int) -> str:
    return (f"dpstate: this {name} was built for generation {generation}, which ended (ranks were reassigned and "
            f"every group rebuilt): read parts.{name} in each step (it is rebuilt by your build(mesh) in every "
            "generation) instead of keeping it")


def _raiser(message: str) -> Callable[..., Any]:
    def stale(*_args: Any, **_kwargs: Any) -> Any:
        raise StalePartsError(message)

    return stale


class _StaleMesh:
    """The class a retired DeviceMesh is given: every public attribute and indexing raise."""

    _message = "dpstate: this DeviceMesh belongs to a generation that ended: read parts.mesh instead"

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            raise StalePartsError(object.__getattribute__(self, "_message"))
        return object.__getattribute__(self, name)

    def __getitem__(self, _key: Any) -> Any:
        raise StalePartsError(_StaleMesh._message)

    def __repr__(self) -> str:
        return "<retired DeviceMesh>"

    def __eq__(self, other: object) -> bool:  # a cache that still holds it compares it without raising
        return self is other

    def __hash__(self) -> int:
        return id(self)


class Parts:
    """This generation's parts by name (parts.model, parts.optimizer, parts.schedule, parts["scheduler"]...)
    and its mesh. Read them in each step: a recovery replaces every one of them."""

    def __init__(self, layout: MeshLayout, build: Build):
        self.layout, self._build = layout, build
        self.generation = -1
        self.mesh: Any = None
        self._parts: dict[str, Any] = {}
        self._retired: weakref.WeakSet[Any] = weakref.WeakSet()

    def __getattr__(self, name: str) -> Any:
        parts = self.__dict__.get("_parts", {})
        if name in parts:
            return parts[name]
        if name in _TUPLE_NAMES:
            return None
        raise AttributeError(f"dpstate: build(mesh) returned no part named {name!r} (it returned {sorted(parts)})")

    def __getitem__(self, name: str) -> Any:
        return self._parts[name]

    def __repr__(self) -> str:
        return f"Parts({self.layout.describe()}, generation={self.generation}, parts={sorted(self._parts)})"

    def stateful(self) -> dict[str, Any]:
        """The parts whose state snapshots hold (those with state_dict and load_state_dict)."""
        return {name: part for name, part in self._parts.items()
                if callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))}

    def build(self, mesh: Any, generation: int) -> None:
        """Call build(mesh) for `generation` and check what it returned."""
        try:
            made = self._build(mesh)
        except (AssertionError, RuntimeError) as exc:
            if "once" in str(exc) and generation > self.generation >= 0:
                raise RuntimeError("dpstate: build(mesh) wrapped a model that an earlier generation already "
                                   f"wrapped ({type(exc).__name__}: {str(exc)[:200]}): make the model inside "
                                   "build(mesh), anew in every generation") from exc
            raise
        parts = self._named(made)
        for name, part in parts.items():
            if part in self._retired:  # (False for what takes no weak reference)
                raise RuntimeError(f"dpstate: build(mesh) returned the {name} of an earlier generation again: make "
                                   "the model, optimizer and schedule inside build(mesh), anew in every generation")
        self.mesh, self._parts, self.generation = mesh, parts, generation

    @staticmethod
    def _named(made: Any) -> dict[str, Any]:
        if isinstance(made, Mapping):
            parts = dict(made)
        elif isinstance(made, (tuple, list)) and 2 <= len(made) <= 3:
            parts = dict(zip(_TUPLE_NAMES, made))
        else:
            raise TypeError("dpstate: build(mesh) must return a dict of parts (model=..., optimizer=..., "
                            "schedule=...) or a tuple (model, optimizer[, schedule]), not "
                            f"{type(made).__qualname__}")
        if not isinstance(parts.get("model"), nn.Module):
            raise TypeError("dpstate: build(mesh) returned no model (an nn.Module under the name 'model')")
        return {name: part for name, part in parts.items() if part is not None}

    def retire(self) -> None:
        """Make this generation's parts unusable and let go of them. DTensor's caches are kept: they hold no part,
        and stay valid for the next generation's mesh of the same layout (torch_private.mesh_group_names)."""
        if not self._parts:
            return
        generation = self.generation
        for name, part in self._parts.items():
            try:
                self._retired.add(part)
            except TypeError:  # no weak references to it: it cannot be told apart later either
                pass
            stale = _raiser(_stale_message(name, generation))
            if isinstance(part, nn.Module):
                for module in part.modules():  # every one: FSDP2's own hooks would all-gather over old groups
                    module.register_forward_pre_hook(stale, prepend=True)
            elif isinstance(part, torch.optim.Optimizer):
                part.register_step_pre_hook(stale)
            elif callable(getattr(part, "step", None)):  # a pipeline schedule (its stage holds old groups)
                for method in ("step", "eval"):
                    if callable(getattr(part, method, None)):
                        setattr(part, method, stale)
        if self.mesh is not None:
            try:
                self.mesh.__class__ = type("RetiredDeviceMesh", (_StaleMesh, type(self.mesh)), {})
            except TypeError:
                pass
        on_gpu = any(p.is_cuda for part in self._parts.values() if isinstance(part, nn.Module)
                     for p in part.parameters())
        self.mesh, self._parts = None, {}
        if on_gpu:  # FSDP2 modules hold reference cycles: a GPU's memory goes back before the next build needs it
            gc.collect()  # (0.3-0.5 s with torch loaded, here: on a CPU host Python's own collections get to it)
