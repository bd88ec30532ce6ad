"""What a snapshot holds: every tracked object's state_dict, the RNG states and the step; capture and restore.
Its "layout" says what the state dicts alone do not (which objects are models and optimizers, the names of an
optimizer's parameters, each shard's place in its global tensor), for exports read without the job (dprun ckpt).

Capture runs in the main thread between steps and only references tensors that the next forward/backward
cannot change (parameters, optimizer state); anything else (buffers, other objects' tensors) is cloned.
"""

from __future__ import annotations

import random
import sys
import warnings
from typing import Any

import torch
from torch import nn

from .checks import replicated_keys
from .shards import ReshardError, local_shards, module_state_like, optimizer_state_like


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _clone_tensors(v)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_clone_tensors(v) for v in obj)
    return obj


def _into_live_state(saved: dict, live: dict) -> dict:
    """An optimizer's saved per-parameter state with each tensor copied into the live tensor of the same
    shape and dtype (the optimizer keeps what load_state_dict is given), else into a fresh copy."""
    out: dict = {}
    with torch.no_grad():
        for key, entries in saved.items():
            mine = live.get(key, {})
            if not isinstance(entries, dict):
                out[key] = _clone_tensors(entries)
                continue
            out[key] = {}
            for name, value in entries.items():
                current = mine.get(name)
                if (isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor)
                        and current.shape == value.shape and current.dtype == value.dtype):
                    current.copy_(value)
                    out[key][name] = current
                else:
                    out[key][name] = _clone_tensors(value)
    return out


def rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


class Tracked:
    """The named objects whose state is snapshotted and restored (models, optimizers, data, schedulers...)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.replicated: list[nn.Module] = []  # modules trained data parallel (job.data_parallel)
        self.ranks: tuple[int, ...] = ()  # the logical ranks the process trains, its own first
        # optimizer name -> (the ids of its parameters, their names): named_parameters() walks every module,
        # on every capture otherwise; the ids say when the optimizer holds other parameters
        self._param_names: dict[str, tuple[tuple, list]] = {}

    def add(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"track({name}=...): {type(obj).__qualname__} has no state_dict()/load_state_dict()")
            if name in self.objects and self.objects[name] is not obj:
                raise ValueError(f"track(): the name {name!r} is already tracked")
            self.objects[name] = obj
        self._param_names.clear()

    def remove(self, *names: str) -> None:
        """Stop tracking `names` (the parts of a generation that ended: their successors are added next)."""
        for name in names:
            self.objects.pop(name, None)
        self._param_names.clear()

    def modules(self) -> list[nn.Module]:
        return [o for o in self.objects.values() if isinstance(o, nn.Module)]

    def replicate(self, module: nn.Module) -> None:
        """`module` is trained data parallel: its parameters and their optimizer state are the same on every
        rank after a step (see shared_keys)."""
        if not any(m is module for m in self.replicated):
            self.replicated.append(module)

    def holds_training_state(self) -> bool:
        """Whether a model or an optimizer is tracked: without them a snapshot holds no training state."""
        return any(isinstance(o, (nn.Module, torch.optim.Optimizer)) for o in self.objects.values())

    def shared_keys(self) -> set:
        """dpstate.snapshot.checks.tensor_key of each tensor that every data parallel rank holds alike after a step."""
        optimizers = [o for o in self.objects.values() if isinstance(o, torch.optim.Optimizer)]
        return replicated_keys(self.replicated, optimizers)

    def capture(self, step: int) -> dict:
        """The state tree of `step` (cheap: parameters and optimizer state are referenced, not copied)."""
        states: dict[str, Any] = {}
        shards: dict[str, list] = {}  # name -> [path, *shards.place()] of each DTensor in its state dict
        for name, obj in self.objects.items():
            sd = obj.state_dict()
            record: list = []
            if isinstance(obj, nn.Module):
                sd = local_shards(sd, record)  # a sharded parameter's snapshot is its own shard
                params = {n for n, _ in obj.named_parameters(remove_duplicate=False)}
                for key in list(sd):
                    if key not in params:  # buffers and extra state may change in the next forward
                        sd[key] = _clone_tensors(sd[key])
            elif isinstance(obj, torch.optim.Optimizer):
                sd = {k: (local_shards(v, record, (k,)) if k == "state" else _clone_tensors(v)) for k, v in sd.items()}
            else:
                sd = _clone_tensors(sd)
            states[name] = sd
            if record:
                shards[name] = record
        layout = {"modules": [n for n, o in self.objects.items() if isinstance(o, nn.Module)],
                  "optimizers": self.param_names(), "shards": shards}
        tree = {"step": step, "state": states, "rng": rng_state(), "threads": torch.get_num_threads(),
                "layout": layout}
        if self.ranks:
            tree["ranks"] = list(self.ranks)  # (dpstate.snapshot.rank_parts)
        return tree

    def param_names(self) -> dict[str, list]:
        """For each tracked optimizer, [module name, parameter name] of each of its parameters in the order of
        its state dict's indices (None: a parameter of no tracked module)."""
        out = {}
        for name, opt in self.objects.items():
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            params = [p for group in opt.param_groups for p in group["params"]]
            ids = tuple(map(id, params))
            known = self._param_names.get(name)
            if known is None or known[0] != ids:
                owner: dict[int, list] = {}
                for module_name, module in self.objects.items():
                    if isinstance(module, nn.Module):
                        for fqn, p in module.named_parameters(remove_duplicate=False):
                            owner.setdefault(id(p), [module_name, fqn])
                known = self._param_names[name] = (ids, [owner.get(i) for i in ids])
            out[name] = known[1]
        return out

    def restore(self, tree: dict, reshard_from: list[dict] | None = None) -> None:
        """Load a state tree whose tensors may be views of a snapshot buffer (they are not kept): modules copy
        into their parameters, optimizers into their existing state tensors (fresh copies where they have
        none yet, e.g. a spare's), anything else gets copies. `reshard_from`: the trees whose shards make up
        this rank's sharded state, taken on a mesh of another shape (dpstate.snapshot.reshard)."""
        missing = set(self.objects) - set(tree["state"])
        if missing:
            raise RuntimeError(f"dpstate: the snapshot of step {tree['step']} has no state for {sorted(missing)} "
                               f"(it holds {sorted(tree['state'])}): the script tracks what was not saved; "
                               "job.track() the same names as the run that saved it")
        if reshard_from is not None:  # DCP and DTensor: imported only by a job that reshards (0.8 s of a start)
            from .reshard import module_state_resharded, optimizer_state_resharded
        for name, obj in self.objects.items():
            sd = tree["state"][name]
            try:
                if reshard_from is not None and isinstance(obj, torch.optim.Optimizer):
                    sd = optimizer_state_resharded(name, sd, obj, reshard_from)
                elif reshard_from is not None and isinstance(obj, nn.Module):
                    sd = module_state_resharded(name, sd, obj.state_dict(), reshard_from)
                elif isinstance(obj, torch.optim.Optimizer):
                    sd = optimizer_state_like(sd, obj)
                    sd = dict(sd, state=_into_live_state(sd.get("state", {}), obj.state_dict().get("state", {})))
                elif isinstance(obj, nn.Module):
                    sd = module_state_like(sd, obj.state_dict())
                else:
                    sd = _clone_tensors(sd)
                obj.load_state_dict(sd)
            except ReshardError as exc:
                raise RuntimeError(f"dpstate: the snapshot of step {tree['step']} cannot be resharded onto this "
                                   f"rank's {name!r}: {exc}") from exc
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                first = " ".join(str(exc).split())[:300]
                raise RuntimeError(f"dpstate: the snapshot of step {tree['step']} does not fit the script's {name!r} "
                                   f"({type(exc).__name__}: {first}): was the model or optimizer changed since "
                                   "that state was saved?") from exc
        for module in self.modules():
            for p in module.parameters():
                p.grad = None
        # copies: torch 2.13's set_rng_state / Generator.set_state read a view with a storage offset from
        # the start of its storage (a segfault here, measured), and snapshot tensors are views of one buffer
        set_rng_state(_clone_tensors(tree["rng"]))
        if tree.get("threads", torch.get_num_threads()) != torch.get_num_threads():
            warnings.warn(f"dpstate: the snapshot of step {tree['step']} was taken with {tree['threads']} intra-op "
                          f"threads and this process uses {torch.get_num_threads()}: CPU results will not be "
                          "bitwise identical to a failure-free run", stacklevel=2)
