"""Many simulated fault schedules run over this host's cores: each seed's schedule in a forked process of a small
pool, its outcome and the paths it took counted (the simulator is pure and deterministic, so the split changes
nothing but the wall time)."""

from __future__ import annotations

import collections
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Sequence

from dprun.sim.runner import run_schedule
from dprun.sim.schedule import random_schedule


def _run_some(seeds: Sequence[int], draw: dict[str, Any], background_only: bool) -> tuple[collections.Counter,
                                                                                       collections.Counter]:
    outcomes: collections.Counter = collections.Counter()
    paths: collections.Counter = collections.Counter()
    for seed in seeds:
        schedule = random_schedule(seed, **draw)
        if background_only and not schedule.background:
            continue
        outcomes[run_schedule(schedule, paths)] += 1
    return outcomes, paths


def run_seeds(seeds: range, background_only: bool = False,
              **draw: Any) -> tuple[collections.Counter, collections.Counter]:
    """random_schedule(seed, **draw) run for every seed (only those with background saves, if asked): how many
    ended each way, and how often each path was taken. A schedule's failure raises here, naming its seed."""
    procs = max(1, min(2, os.cpu_count() or 1))
    shares = [seeds[i::procs] for i in range(procs)]  # (a range's slices: ranges, no lists)
    outcomes: collections.Counter = collections.Counter()
    paths: collections.Counter = collections.Counter()
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
        for done in [pool.submit(_run_some, share, draw, background_only) for share in shares]:
            more_outcomes, more_paths = done.result()
            outcomes.update(more_outcomes)
            paths.update(more_paths)
    return outcomes, paths
