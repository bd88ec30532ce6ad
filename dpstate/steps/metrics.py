"""What a step's metrics (step.log) become in its Progress to dprun: JSON-able values, each small enough, so that
the Progress, and with it the step that the controller counts on, always reaches the agent."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

MAX_METRIC_BYTES = 1024  # one step.log() value as JSON: metrics are meant to be a few scalars
MAX_METRICS_BYTES = 16 << 10  # all of a step's metrics together, far under protocol.MAX_BODY_BYTES
_warned_metrics: set[str] = set()  # names already said on stderr


def sendable_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """step.log()'s metrics as sent in a Progress: made JSON-able, each at most MAX_METRIC_BYTES as JSON (bigger
    ones are dropped) and all together at most MAX_METRICS_BYTES (else none is sent), so that the Progress, and
    with it the step, always reaches the agent. Each dropped name is said on stderr once per process."""
    kept = {}
    for name, value in metrics.items():
        value = _jsonable(value)
        size = _json_bytes(value)
        if size <= MAX_METRIC_BYTES:
            kept[name] = value
        else:
            _warn_once([name], f"step.log({name}=...) is {size} bytes as JSON, over {MAX_METRIC_BYTES}: "
                               "not sent to dprun (log scalars; write big values yourself)")
    total = _json_bytes(kept)
    if total > MAX_METRICS_BYTES:
        _warn_once(list(kept), f"step.log({', '.join(kept)}) is {total} bytes as JSON together, over "
                               f"{MAX_METRICS_BYTES}: none of it sent to dprun (log a few scalars)")
        kept = {}
    return kept


def _json_bytes(value: Any) -> int:
    """Its size as protocol.Codec encodes a body."""
    return len(json.dumps(value, separators=(",", ":")).encode())


def _warn_once(names: list[str], message: str) -> None:
    if not _warned_metrics.issuperset(names):
        _warned_metrics.update(names)
        print(f"dpstate: {message}", file=sys.stderr, flush=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        plain = value.item() if value.numel() == 1 else value.tolist()
        return str(plain) if value.is_complex() else plain  # (JSON has no complex numbers)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
