"""AdamW whose step can write the state it makes straight into the buffer of the snapshot about to be taken
(dpstate.snapshot.landing), so that a per-step snapshot copies no parameters or optimizer state on a CPU host.

It is torch.optim.AdamW (same constructor, state_dict, results bit for bit): the session tells it, before each
step, where each parameter's and moment's new value goes; the old values stay where they were, untouched, as
the previous snapshot. Without that (no dprun, CUDA, snapshots off, options the plain path does not cover) it
runs torch's own step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

# torch's step without the hook wrapper that Optimizer puts around every class's step (the pre- and post-step
# hooks already ran once, around ours)
_torch_step = inspect.unwrap(torch.optim.Adam.step)

# the tensor that a tensor's next value is written into; None: its own (or, if it lies in a snapshot buffer, the
# memory it had before)
Destination = Callable[[torch.Tensor], torch.Tensor | None]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW that writes its result where `landing` says (set by dpstate for one step at a time).

    The landing path covers torch's default CPU step (foreach and fused off or unset, no amsgrad, capturable or
    differentiable, real dense tensors); anything else takes torch's step, unchanged."""

    landing: Destination | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (parameter index, "param" | "exp_avg" | "exp_avg_sq") of each tensor that lies in a snapshot buffer ->
        # the memory it had before, kept: going home after a failure is then one copy into memory already there
        # (fresh memory cost ~0.1 s more per 108 MB of recovery here; freed, glibc kept it for the activations)
        self._home: dict[tuple[int, str], torch.Tensor] = {}

    def lands(self) -> bool:
        """Whether a step can write its result elsewhere: every parameter on the CPU, torch's default path."""
        for group in self.param_groups:
            if group["amsgrad"] or group["capturable"] or group["differentiable"] or group["fused"] or group["foreach"]:
                return False
            if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
                return False
            for p in group["params"]:
                if not p.is_cpu or torch.is_complex(p) or (p.grad is not None and p.grad.is_sparse):
                    return False
        return True

    @torch.no_grad()
    def step(self, closure=None):
        destination, self.landing = self.landing, None
        started = all(self.state.get(p) for g in self.param_groups for p in g["params"] if p.grad is not None)
        if destination is None or not started or not self.lands():  # the first step makes the moments: torch's
            self.go_home()
            return _torch_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # of the parameter over every group, as _params() and the state dict number them
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                targets = [self._where((index, name), t, destination) for name, t in
                           (("param", p.data), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))]
                _adamw_into(p, state, group, *targets)
        return loss

    @torch.no_grad()
    def go_home(self) -> None:
        """Copy every tensor that lies in a snapshot buffer back into the memory it had (a reconfiguration,
        which reuses the buffers, or a step that does not land), so that nothing writes a snapshot in place."""
        params = self._params()
        for (index, name), home in self._home.items():
            p = params[index]
            current = p.data if name == "param" else self.state[p][name]
            if current.data_ptr() != home.data_ptr():
                home.copy_(current)
                if name == "param":
                    p.data = home
                else:
                    self.state[p][name] = home
        self._home.clear()

    def _where(self, key: tuple[int, str], t: torch.Tensor, destination: Destination) -> torch.Tensor:
        """Where tensor `key` (now `t`) gets its next value: where it lands; else in place, or, if it lies in a
        snapshot buffer, back in the memory it had."""
        target = destination(t)
        if target is None:
            return self._home.pop(key, t)
        if target is not t:
            self._home.setdefault(key, t)
        return target

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]


def _adamw_into(p: torch.Tensor, state: dict, group: dict, new_p: torch.Tensor, new_avg: torch.Tensor,
                new_avg_sq: torch.Tensor) -> None:
    """One parameter's AdamW update (torch's single-tensor step, op for op) with each result written to its new
    tensor (the old one where it is the same); the parameter and its moments then refer to the new tensors."""
    beta1, beta2 = group["betas"]
    lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
    grad = p.grad
    assert grad is not None  # step() skips the parameters without one
    if group["maximize"]:
        grad = -grad
    param, exp_avg, exp_avg_sq, step_t = p.data, state["exp_avg"], state["exp_avg_sq"], state["step"]
    moved = new_p.data_ptr() != param.data_ptr()
    step_t += 1
    if weight_decay != 0:
        torch.mul(param, 1 - lr * weight_decay, out=new_p)
    elif moved:
        new_p.copy_(param)
    torch.lerp(exp_avg, grad, 1 - beta1, out=new_avg)
    torch.mul(exp_avg_sq, beta2, out=new_avg_sq).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (new_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    new_p.addcdiv_(new_avg, denom, value=-step_size)
    if moved:
        p.data = new_p
    state["exp_avg"], state["exp_avg_sq"] = new_avg, new_avg_sq
