"""What a gradient log would cost per step on this host, against the whole-state copy it would replace: the
benchmark model trained by 2 ranks (torchrun, DDP, AdamW), plain steps alternated with steps that also keep that
step's all-reduced gradient (copied into shared memory, or by reference) or copy the whole state, each between plain steps.

A gradient log (the whole state every K steps, each step's gradient in between, replayed through the optimizer
on restore) would snapshot a third of the bytes of AdamW's state per step; this measures whether that is cheaper
here before anyone builds it (docs/performance.md). Prints a table; `--json PATH` writes the numbers. A run that
fails is said with its exit code and the tail of its output, and the benchmark exits 1 without figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_gradient_log_train.py"
SMALL = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64"]
# --quick: the 10 steps left out, then one window of each mode (a plain step, the mode's, a plain one) and of 3
# plain steps in a row (steps 19-21: the turn's last plain step and the next turn's first two)
QUICK_STEPS = 22


def window_ms(steps: list[dict], mode: str, skip: int) -> float | None:
    """What a `mode` step adds, in ms, what it leaves to the step after it included: the median time of the
    2 steps from a `mode` step (the next is plain) less that of 2 plain steps in a row, each after a plain."""
    def windows(first: str) -> list[float]:
        return [(b["s"] + c["s"]) * 1000 for a, b, c in zip(steps[skip:], steps[skip + 1:], steps[skip + 2:])
                if a["mode"] == "plain" and b["mode"] == first and c["mode"] == "plain"]
    base, got = C.median(windows("plain")), C.median(windows(mode))
    return None if base is None or got is None else got - base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500, help="steps per run (10 in turn: 4 modes, 6 plain)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small model, 22 steps, 1 run (smoke test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    C.install_cleanup()
    steps, runs, model = (QUICK_STEPS, 1, SMALL) if args.quick else (args.steps, args.runs, [])
    work = C.Workdir("gradlog", args.keep)
    failures = C.Failures("gradient_log", work)
    modes = ("gradient", "gradient_after", "whole", "by_reference")
    results = []
    try:
        folder = work.new("alone")
        out = folder / "alone.json"
        run = C.run("alone", [sys.executable, WORKER, "--alone-steps", 3 if args.quick else 12, "--out", out, *model],
                    folder=folder, env={"OMP_NUM_THREADS": "1"})
        if not failures.check(run):
            return failures.exit_code()
        alone_ms = json.loads(out.read_text())
        for i in range(runs):
            folder = work.new(f"run{i}")
            out = folder / "steps.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
                   "--steps", steps, "--out", out, *model]
            run = C.run(f"run{i}", cmd, folder=folder, env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
            if not failures.check(run):
                return failures.exit_code()
            got = json.loads(out.read_text())
            plain = C.median(s["s"] for s in got["steps"][6:] if s["mode"] == "plain")
            results.append({"grad_bytes": got["grad_bytes"], "state_bytes": got["state_bytes"],
                            "plain_step_s": plain, "added_ms": {m: window_ms(got["steps"], m, 10) for m in modes}})
    finally:
        work.close()
    def cell(added: float | None, plain_s: float) -> str:  # "-" where no window of a mode was measured
        return "-" if added is None else f"{added:+.1f} ({added / 10 / plain_s:+.2f} %)"

    rows = []
    for i, r in enumerate(results):
        rows.append([f"run {i}", C.fmt(r["plain_step_s"] * 1000, ".0f")] +
                    [cell(r["added_ms"][m], r["plain_step_s"]) for m in modes])
    print(f"state {C.mb(results[0]['state_bytes'])} MB, gradient {C.mb(results[0]['grad_bytes'])} MB per rank; "
          "ms added by a step of each kind, the plain step after it included, against 2 plain steps (medians):")
    print(C.table(["", "plain step ms", "gradient copied", "... after the step", "whole state copied",
                   "gradient by reference"], rows))
    print(f"alone, one process (ms): optimizer step {alone_ms['optimizer_step']}, gradient copied before it "
          f"{alone_ms['gradient']}, after it {alone_ms['gradient_after']}, whole state copied {alone_ms['whole']}")
    C.write_json(args.json, {"machine": C.machine(), "alone_ms": alone_ms, "runs": results,
                             "added_ms": {m: C.median(r["added_ms"][m] for r in results) for m in modes}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
