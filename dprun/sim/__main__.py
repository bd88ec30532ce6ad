"""Soak: `python -m dprun.sim --schedules 100000 [--seed S]` runs that many random fault schedules.

Prints the outcomes, and how many schedules went through each path of background saves and restores from disk;
on a violation prints the seed that replays it (`--only SEED`, with the same --shrink) and exits 1.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from .invariants import InvariantViolation
from .runner import PATHS, run_schedule
from .schedule import SHRINK_SHARE, random_schedule


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dprun.sim", description=__doc__)
    parser.add_argument("--schedules", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--only", type=int, help="replay this one seed")
    parser.add_argument("--max-nodes", type=int, default=4)
    parser.add_argument("--shrink", type=float, default=SHRINK_SHARE,
                        help="the fraction of schedules run --on-spare-exhausted shrink (default %(default)s)")
    args = parser.parse_args(argv)
    seeds = [args.only] if args.only is not None else range(args.seed, args.seed + args.schedules)
    outcomes: collections.Counter = collections.Counter()
    paths: collections.Counter = collections.Counter()
    start = time.perf_counter()
    for seed in seeds:
        try:
            outcomes[run_schedule(random_schedule(seed, args.max_nodes, shrink=args.shrink), paths)] += 1
        except InvariantViolation as exc:
            print(f"VIOLATION (replay with --only {seed} --shrink {args.shrink}):\n{exc}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - start
    print(f"{sum(outcomes.values())} schedules in {elapsed:.1f} s: {dict(outcomes)}")
    print(f"schedules through: {', '.join(f'{path} {paths[path]}' for path in PATHS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
