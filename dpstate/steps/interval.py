"""Which steps are snapshotted: every N-th, off, or auto (the measured cost of a snapshot against a budget).

SnapshotPolicy is pure bookkeeping over step times; the session all-reduces its measurements so every rank decides
alike.
"""

from __future__ import annotations

import math
import os
import statistics
import time

POLICY_NAME = "__dpstate_snapshot_policy__"  # the name under which an auto policy's decision is tracked
DEFAULT_BUDGET = 0.01
MAX_INTERVAL = 10_000
PROBE_EVERY = 16  # at an auto interval of 1, one step in this many is not snapshotted, to keep measuring
AUTO_WARMUP, AUTO_PAIRS = 3, 16  # auto's defaults (DP_SNAPSHOT_AUTO_STEPS): decided at the end of step 36
COST_BOUND_SE = 1.0  # auto picks its interval for the cost plus this many standard errors (~84 % one-sided)


class SnapshotPolicy:
    """Which steps are snapshotted, from DP_SNAPSHOT_INTERVAL (dprun --snapshot-interval): ``N`` (step 0 and
    every multiple of N; 1 by default), ``off``, or ``auto[:BUDGET]``: the smallest interval whose measured
    snapshot cost stays under BUDGET of step time, bounded by Young and Daly's optimum once failures come.
    How auto measures and decides, and why every rank decides alike: docs/dpstate.md ("Snapshot interval").
    """

    # The samples _reset_samples() (re)sets; declared here so that their types are known throughout.
    _since: int | None  # the first step of the current run of consecutive steps
    _last: int | None  # the newest step recorded
    _last_t: float  # when it ended (perf_counter)
    _with: list[float]
    _without: list[float]
    _pairs: list[float]  # (step after a snapshot) - (the next step, after none)
    _pending: float | None
    _new_pairs: int  # pairs since the last decision
    _step_s: float

    def __init__(self, spec: str | None = "1", budget: float | str | None = None,
                 warmup: int = AUTO_WARMUP, pairs: int = AUTO_PAIRS, refresh: int = 4):
        text = (spec or "1").strip().lower()
        self.budget = float(budget) if budget not in (None, "") else DEFAULT_BUDGET
        if text.startswith("auto"):
            _, _, given = text.partition(":")
            if given:
                self.budget = float(given.rstrip("%")) / (100 if given.endswith("%") else 1)
            self.mode, self.interval = "auto", 1
        elif text in ("off", "0", "none", "never"):
            self.mode, self.interval = "off", 0
        else:
            try:
                self.interval = int(text)
            except ValueError:
                raise ValueError(f"DP_SNAPSHOT_INTERVAL must be a positive number, 'auto[:BUDGET]' or 'off', "
                                 f"got {spec!r}") from None
            if self.interval < 1:
                raise ValueError(f"DP_SNAPSHOT_INTERVAL must be at least 1 (or 'off'), got {spec!r}")
            self.mode = "fixed"
        if not 0 < self.budget < 1:
            raise ValueError(f"the snapshot budget must be a fraction between 0 and 1, got {self.budget:g}")
        self.warmup, self.pairs, self.refresh = max(0, warmup), max(1, pairs), max(1, refresh)
        self.decisions = 0
        self.decided = self.mode != "auto"
        self.cost: float | None = None  # measured fraction of a step's time that one snapshot costs (auto)
        self.cost_bound: float | None = None  # the cost plus COST_BOUND_SE standard errors: what sets the interval
        self.decided_at = -1
        self.decided_generation = -1
        self.mtbf_s: float | None = None  # failures seen: the interval is bounded by Young/Daly's optimum
        self.t0: float | None = None  # wall clock of the job's first step (travels in snapshots)
        self.generation = 0
        self.defers = False  # the session's gate waits for acks at snapshot steps only (dpstate.steps.gate)
        self.lag_steps = 0.0  # agreed: steps from the gate after a snapshot to its acks (deferring gates)
        self._lags: list[float] = []  # this rank's newest such lags, in seconds
        self._reset_samples()

    @classmethod
    def from_env(cls) -> "SnapshotPolicy":
        warmup, _, pairs = os.environ.get("DP_SNAPSHOT_AUTO_STEPS", "").partition(",")
        return cls(os.environ.get("DP_SNAPSHOT_INTERVAL", "1"), os.environ.get("DP_SNAPSHOT_BUDGET"),
                   int(warmup or AUTO_WARMUP), int(pairs or AUTO_PAIRS))

    def __repr__(self) -> str:
        return f"SnapshotPolicy({self.describe()})"

    def describe(self) -> str:
        if self.mode == "off":
            return "off"
        if self.mode == "fixed":
            return f"every {self.interval} step(s)"
        if not self.decided:
            return f"auto (budget {self.budget:.1%}, measuring)"
        why = (f", bounded by the failures so far (one every {self.mtbf_s:.0f} s)"
               if self.mtbf_s is not None and self.interval < self.budget_interval else "")
        bound = (f" (at most {self.cost_bound:.2%} within one standard error)"
                 if self.cost_bound is not None and self.cost_bound > (self.cost or 0.0) else "")
        if self.lag_steps > 0:
            bound += f", acked {self.lag_steps:.1f} step(s) after the next gate"
        return (f"auto: one snapshot costs {self.cost:.2%} of a step{bound}, budget {self.budget:.1%} -> every "
                f"{self.interval} step(s){why}, worst case {self.max_lost_steps} step(s) lost")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def max_lost_steps(self) -> int:
        """Steps a failure can cost at most with the interval in force (0 when off: everything is lost)."""
        if self.mode == "off":
            return 0
        interval = self.interval if self.decided and not self.probing else 2
        return 2 * interval if self.defers else interval + 1

    @property
    def probing(self) -> bool:
        """Decided on an interval of 1 (auto): every step is snapshotted but one in PROBE_EVERY."""
        return self.mode == "auto" and self.decided and self.interval == 1

    @property
    def budget_interval(self) -> int:
        """The smallest interval that keeps the measured cost (its upper bound, and the stall that a replication
        slower than the steps between snapshots leaves: lag_steps) under the budget."""
        cost = max(self.cost or 0.0, self.cost_bound or 0.0)
        interval = min(MAX_INTERVAL, max(1, math.ceil(cost / self.budget - 1e-9)))
        if self.lag_steps <= 0:
            return interval

        def per_step(n: int) -> float:
            return (cost + max(0.0, self.lag_steps - (n - 1))) / n

        while interval < MAX_INTERVAL and per_step(interval) > self.budget * (1 + 1e-9):
            interval += 1  # per_step falls as n grows; at most lag_steps + 1 more than the cost alone needs
        return interval

    # ------------------------------------------------------------------ schedule

    def _window(self) -> tuple[int, int]:
        start = (self._since or 0) + self.warmup
        return start, start + 2 * self.pairs  # measured steps: [start, end)

    def wants(self, step: int) -> bool:
        """Is `step` snapshotted? A pure function of the decision and the measuring window."""
        if self.mode == "off":
            return False
        if step <= 0:
            return True
        if self.decided:
            if self.probing:
                return step % PROBE_EVERY != PROBE_EVERY - 1
            return step % self.interval == 0
        start, end = self._window()
        if self._since is None or step < start or step >= end:
            return True
        return (step - start) % 2 == 0

    def after_step(self, step: int, now: float, generation: int = 0) -> bool:
        """Record that `step` ended at `now` (perf_counter) in `generation`; True when an auto decision is due
        at this step (the same step on every rank: they all call local_measurements / decide_from)."""
        if self.mode != "auto":
            return False
        self.generation = generation
        if self.t0 is None:
            self.t0 = time.time()
        if self._since is None or self._last is None or step != self._last + 1:
            self._reset_samples()
            self._since = step
        elif self.decided:  # steady state: steps after a snapshot vs. the others
            self._record(self.wants(self._last), now - self._last_t)
        else:
            start, end = self._window()
            if start < step <= end:  # the step before it is in the alternating window
                self._record(self.wants(self._last), now - self._last_t)
        self._last, self._last_t = step, now
        if self.decided:
            if generation != self.decided_generation:
                return True  # a recovery since the decision: the failure rate changed, decide again now
            # every `refresh` new pairs since the last decision (one per snapshot, or per probe at interval 1)
            return self.wants(step) and self._new_pairs >= self.refresh
        return step == self._window()[1]

    def _record(self, after_snapshot: bool, seconds: float) -> None:
        if after_snapshot:
            self._with.append(seconds)
            self._pending = seconds
        else:
            self._without.append(seconds)
            if self._pending is not None:  # the step right after one that followed a snapshot: a pair
                self._pairs.append(self._pending - seconds)
                self._pending = None
                self._new_pairs += 1
        del self._with[: -2 * self.refresh], self._pairs[: -2 * max(self.refresh, self.pairs)]
        del self._without[:-64]

    def local_cost(self) -> float:
        """This rank's measured cost of one snapshot, as a fraction of a step without one: the interquartile
        mean over pairs of adjacent steps (one after a snapshot, the next after none) of their difference, over
        the median step without one. Adjacent steps share the host's condition, so other jobs' bursts on a
        shared machine mostly cancel out (a difference of two medians of separate steps does not). Without new
        samples (the first step after a recovery): the cost decided before."""
        if not self._without:
            return self.cost or 0.0
        base = statistics.median(self._without)
        if base <= 0:
            return self.cost or 0.0
        if self._pairs:
            return max(0.0, interquartile_mean(self._pairs) / base)
        return max(0.0, (statistics.median(self._with) - base) / base) if self._with else (self.cost or 0.0)

    def local_cost_bound(self) -> float:
        """local_cost() plus COST_BOUND_SE standard errors of its interquartile mean (from the winsorized
        spread of the pairs); the cost itself with fewer than 4 pairs."""
        cost = self.local_cost()
        base = statistics.median(self._without) if self._without else 0.0
        if len(self._pairs) < 4 or base <= 0:
            return cost
        return cost + COST_BOUND_SE * interquartile_mean_error(self._pairs) / base

    def local_measurements(self) -> list[float]:
        """[cost of a snapshot (fraction of a step), its upper bound, seconds since the job's first step, step
        time, lag in steps (deferring gates)]: every rank all-reduces them with MAX and passes the result to
        decide_from()."""
        step_s = statistics.median(self._without) if self._without else self._step_s
        lag = max(0.0, statistics.median(self._lags)) / step_s if self._lags and step_s else 0.0
        return [self.local_cost(), self.local_cost_bound(), max(0.0, time.time() - (self.t0 or time.time())),
                step_s or 0.0, lag]

    def record_lag(self, seconds: float) -> None:
        """How long after the first gate that followed a snapshot its acks came (dpstate.steps.gate.lag)."""
        self._lags = (self._lags + [seconds])[-2 * self.refresh:]

    def decide_from(self, agreed: list[float], step: int = -1) -> int:
        cost, bound, elapsed, step_s, lag = (float(x) for x in agreed)
        return self.decide(cost, step, elapsed_s=elapsed, step_s=step_s, bound=bound, lag_steps=lag)

    def decide(self, cost: float, step: int = -1, elapsed_s: float = 0.0, step_s: float = 0.0,
               bound: float | None = None, lag_steps: float = 0.0) -> int:
        """Fix the interval from the cost and its upper bound agreed over the ranks (the largest): the budget's,
        bounded by Young and Daly's optimum for the cost once failures were seen (generation > 0 recoveries in
        elapsed_s)."""
        self.cost = max(0.0, float(cost))
        self.cost_bound = max(self.cost, float(bound)) if bound is not None else self.cost
        self.lag_steps = max(0.0, float(lag_steps)) if self.defers else 0.0
        self.interval = self.budget_interval
        self.mtbf_s = None
        if step_s <= 0 and self._without:
            step_s = statistics.median(self._without)
        if step_s > 0:
            self._step_s = step_s
        if self.generation > 0 and elapsed_s > 0 and self._step_s > 0:
            self.mtbf_s = elapsed_s / self.generation
            optimum = math.sqrt(2 * self.cost * self.mtbf_s / self._step_s)
            if self.lag_steps > 0:  # not so often that each snapshot waits for the one before it
                optimum = max(optimum, math.ceil(self.lag_steps) + 1)
            self.interval = max(1, min(self.interval, round(optimum)))
        self.decided, self.decided_at, self.decided_generation = True, step, self.generation
        self.decisions += 1
        self._new_pairs = 0
        return self.interval

    def _reset_samples(self) -> None:
        self._since = None
        self._last = None
        self._last_t = 0.0
        self._with = []
        self._without = []
        self._pairs = []
        self._pending = None
        self._new_pairs = 0
        if not hasattr(self, "_step_s"):
            self._step_s = 0.0

    # ------------------------------------------------------------------ part of every snapshot (auto)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "interval": self.interval, "decided": self.decided,
                "cost": self.cost, "cost_bound": self.cost_bound, "budget": self.budget, "decided_at": self.decided_at,
                "decided_generation": self.decided_generation, "t0": self.t0, "step_s": self._step_s,
                "mtbf_s": self.mtbf_s, "lag_steps": self.lag_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") == self.mode:
            self.interval, self.decided = int(state["interval"]), bool(state["decided"])
            self.cost, self.decided_at = state.get("cost"), int(state.get("decided_at", -1))
            self.cost_bound = state.get("cost_bound", self.cost)
            self.decided_generation = int(state.get("decided_generation", -1))
            self.t0 = state.get("t0", self.t0)
            self._step_s = float(state.get("step_s") or 0.0)
            self.mtbf_s = state.get("mtbf_s")
            self.lag_steps = float(state.get("lag_steps") or 0.0)
        self._reset_samples()  # a rollback: measure again from the restore step if undecided


def interquartile_mean(values: list[float]) -> float:
    """The mean of the middle half of `values` (a quarter dropped at each end; all of them when fewer than 4).
    On this host's step times it spread a fifth less than the median of as many pairs, and like the median it
    is not moved by a burst that slows a few steps (docs/performance.md, Auto)."""
    ordered = sorted(values)
    cut = len(ordered) // 4
    middle = ordered[cut: len(ordered) - cut]
    return sum(middle) / len(middle)


def interquartile_mean_error(values: list[float]) -> float:
    """The standard error of interquartile_mean(values): the spread of the values winsorized at the quarters
    (Tukey and McLaughlin's estimate for a trimmed mean), over (1 - 2 x the trimmed share) x sqrt(n)."""
    ordered = sorted(values)
    n, cut = len(ordered), len(ordered) // 4
    if n < 2:
        return 0.0
    low, high = ordered[cut], ordered[n - 1 - cut]
    winsorized = [min(max(v, low), high) for v in ordered]
    return statistics.stdev(winsorized) / ((1 - 2 * cut / n) * math.sqrt(n))
