"""Smoke tests of benchmarks/ (tiny settings: they check the runs work and the JSON keeps its contract, not the
numbers), and of what the torchrun baseline needs from examples/train_gpt.py: it runs unmodified under plain
torchrun (env:// group, no snapshots) with the same result as under dprun, and resumes from its disk
checkpoints after `torchrun --max-restarts` restarts the workers. And that a benchmark whose run fails says
why, gives that run no figure and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from helpers.e2e import TRAIN, TRAIN_ARGS

pytestmark = [pytest.mark.slow]
BENCH = REPO / "benchmarks"


def run_bench(procs, tmp_path, name: str, *args: str, timeout: float = 150, env: dict[str, str] | None = None,
              json_name: str | None = None) -> tuple[int, str, Path]:
    """benchmarks/{name}.py with `args` (and `env` added to its environment): its exit status, its output (stdout
    and stderr), the path of its JSON ({json_name or name}.json)."""
    out = tmp_path / f"{json_name or name}.json"
    proc = procs.popen([sys.executable, str(BENCH / f"{name}.py"), *args, "--json", str(out)], cwd=tmp_path,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.kill_all()
        text, _ = proc.communicate(timeout=30)  # what it printed until then: which run it was in, how far
        raise AssertionError(f"benchmarks/{name}.py did not finish in {timeout} s; its output:\n{text[-4000:]}") \
            from None
    return proc.returncode, text, out


def bench(procs, tmp_path, name: str, *args: str, timeout: float = 150, env: dict[str, str] | None = None,
          json_name: str | None = None) -> dict:
    code, text, out = run_bench(procs, tmp_path, name, *args, timeout=timeout, env=env, json_name=json_name)
    assert code == 0, text[-4000:]  # the end of the output lists the runs that failed, with their causes
    return json.loads(out.read_text())


def torchrun(procs, tmp_path, name: str, *args: str, max_restarts: int = 0, timeout: float = 120) -> dict:
    summary = tmp_path / f"{name}.summary.json"
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.update({k: "" for k in os.environ if k.startswith("DP_")})
    proc = procs.popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", str(max_restarts), str(TRAIN), *TRAIN_ARGS, *args,
                        "--summary", str(summary), "--stats", str(tmp_path / f"{name}.stats.json")],
                       cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, text[-4000:]
    return {**json.loads(summary.read_text()), **json.loads((tmp_path / f"{name}.stats.json").read_text())}


@pytest.mark.timeout(200)
def test_train_gpt_under_torchrun_matches_dprun_and_resumes_from_disk_checkpoints(procs, tmp_path, unbroken):
    """One torchrun run serves both claims: its first incarnation trains under torchrun's own group to step 8 and
    checkpoints at step 5; after the kill torchrun restarts the workers, they resume from that checkpoint, and
    the run ends bit for bit where dprun's unbroken run of the same shape (2 nodes, 12 steps) does."""
    restarted = torchrun(procs, tmp_path, "restarted", "--steps", "12", "--ckpt-dir", str(tmp_path / "ckpt"),
                         "--ckpt-every", "5", "--kill-at-step", "8", "--timings", str(tmp_path / "t.jsonl"),
                         max_restarts=1)
    assert restarted["world_size"] == 2 and restarted["final_step"] == 12  # torchrun's group, not two world-1 runs
    assert restarted["restart"] == 1
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x.get("event") == "resumed"] == [5]  # from the checkpoint of step 5
    # dprun's run of the same shape, shared with the other tests that compare with it
    assert unbroken(2, 12).summary["params_sha256"] == restarted["params_sha256"]


@pytest.mark.timeout(200)
def test_overhead_quick(procs, tmp_path):
    got = bench(procs, tmp_path, "overhead", "--quick", "--steps", "12")
    assert set(got["throughput"]) == {"off", "per_step", "auto", "torchrun", "alternate"}
    assert all(v and v > 0 for v in got["throughput"].values()), got["throughput"]
    for key in ("overhead_per_step", "overhead_auto", "auto_interval", "overhead_per_step_paired",
                "main_thread_slowed_ms_per_step", "overhead_auto_paired", "paired_optimizer_ms"):
        assert isinstance(got[key], (int, float)), key
    assert got["paired_pairs"] == 3  # steps 7, 9, 11 (each after a snapshot step) against 6, 8, 10
    assert got["profile"]["capture_cpu_ms_median"] > 0
    # worst case: the interval + 1 steps; at an interval of 1 auto still leaves out one step in 16 to measure
    # (SnapshotPolicy.probing), so 2 + 1 then
    interval = got["auto_interval"]
    assert interval >= 1 and got["auto_max_lost_steps"] == (3 if interval == 1 else interval + 1), got
    assert got["auto_cost_bound"] >= got["auto_cost"] >= 0  # the interval is chosen for the bound
    assert got["overhead_auto_paired"] == pytest.approx(max(got["overhead_per_step_paired"], 0) / got["auto_interval"])
    assert got["peak_rss"]["per_step"]["worker"] > 0 and got["peak_rss"]["per_step"]["agent"] > 0
    assert got["profile"]["snapshots"] > 0


@pytest.mark.timeout(200)
def test_recovery_quick(procs, tmp_path):
    got = bench(procs, tmp_path, "recovery", "--quick", "--steps", "16", "--kill-at", "12", "--ckpt-every", "5")
    assert set(got["lost_s"]) == {"deadpool", "torchrun", "torchft"}
    assert isinstance(got["lost_s"]["deadpool"], float) and isinstance(got["lost_s"]["torchrun"], float)
    assert got["floor_s"] > 0 and got["deadpool_detect_to_step_s"] > 0
    runs = {(r["system"], r["fault"]): r for r in got["runs"]}
    assert runs[("torchrun", "kill-worker")]["resumed_from"] == 10  # its newest disk checkpoint
    assert runs[("deadpool", "kill-worker")]["recomputed_steps"] <= 2


@pytest.mark.timeout(150)
def test_scaling_quick(procs, tmp_path):
    """Part 2 of the scaling benchmark, a real recovery at 10 MB (a node killed at step 6 of 12). Part 1 (capture,
    replicate, restore against the limits, at 10 MB with 2 repetitions) is gpu.sh's pipeline stage, whose
    JSON tests/test_gpu_script.py's dry run checks: the same command, run there once for both."""
    got = bench(procs, tmp_path, "scaling", "--sizes", "", "--recovery-sizes", "10", "--recovery-steps", "12")
    assert got["sizes"] == [] and got["failed"] == [], got
    (rec,) = got["recovery"]
    assert rec["returncode"] == 0 and rec["restore_s"] > 0 and rec["total_s"] > 0


@pytest.mark.timeout(200)
def test_goodput_quick(procs, tmp_path):
    # 18 s a system: DeadPool's 3 nodes train from ~9 s on a quiet 2-core host, and each is killed once (at 6 s,
    # or as soon as it has trained) with time left to recover; a run that never trained fails, said
    got = bench(procs, tmp_path, "goodput", "--quick", "--minutes", "0.3", "--every", "6", timeout=180)
    assert set(got["goodput"]) == {"deadpool", "torchrun"}
    assert all(0 < v <= 1.05 for v in got["goodput"].values()), got["goodput"]
    assert got["failures"]["deadpool"] >= 1 and got["failures"]["torchrun"] >= 1


@pytest.mark.timeout(150)
def test_goodput_failed_runs_say_why_and_give_no_figure(procs, tmp_path):
    """A run that fails is no goodput of 0.0: the benchmark names the system and the cause, shows the tail of its
    log, keeps its folder, writes no figure for it and exits 1. DeadPool's head dprun ends early: it refuses its
    --snapshot-interval at once (the cheapest early end; the tail of its log says why); torchrun's training text
    does not exist, so it restarts its workers until the run's time is up, without a step (how a run on a host
    too busy to start training in time ends, too)."""
    missing = tmp_path / "no-such-text.txt"
    for system, args, cause in (
            ("deadpool", ("--minutes", "2", "--dp-interval", "never"),
             "RuntimeError: the head dprun ended early (exit code "),
            ("torchrun", ("--minutes", "0.1", "--data", str(missing)), "RuntimeError: no training step done in ")):
        code, text, out = run_bench(procs, tmp_path, "goodput", "--quick", "--systems", system, "--every", "5", *args,
                                    timeout=140)
        assert code == 1, text[-4000:]
        assert f"{system}: FAILED: {cause}" in text, text[-4000:]
        assert "0.0%" not in text and "goodput 0" not in text, text[-4000:]
        got = json.loads(out.read_text())
        assert got["goodput"] == got["final_step"] == got["step_s"] == got["details"] == {}, got
        (failed,) = got["failed"]
        assert failed["run"] == system and failed["cause"].startswith(cause), failed
        assert Path(failed["folder"]).is_dir()  # kept, with the logs
        if system == "deadpool":  # its end came from dprun's own error, shown from the tail of its log
            assert "--snapshot-interval must be" in text and "'never'" in text, text[-4000:]


def test_gradient_log_quick(procs, tmp_path):
    """The gradient log probe: each mode paired with a plain step, in one real 2-rank torchrun job."""
    got = bench(procs, tmp_path, "gradient_log", "--quick")
    (run,) = got["runs"]
    assert run["state_bytes"] == 3 * run["grad_bytes"] > 0 and run["plain_step_s"] > 0
    assert set(run["added_ms"]) == {"gradient", "gradient_after", "whole", "by_reference"}
    assert all(v is not None for v in run["added_ms"].values()), run
    assert set(got["alone_ms"]) == {"optimizer_step", "gradient", "gradient_after", "whole"}
    assert all(v > 0 for v in got["alone_ms"].values()), got["alone_ms"]


@pytest.mark.timeout(200)
def test_cuda_step_on_the_cpu(procs, tmp_path):
    """The CUDA step benchmark's code on the CPU (its smoke run): both modes measured, auto decided, and
    without a GPU the default device says so and exits 0. A snapshot costs about a whole CPU step here, so at a
    1 % budget auto snapshots every ~100 steps and its blocks at that interval take ~40 s; at 50 % (as gpu.sh's
    dry run) the interval is a few steps, and auto decides after 9 steps (DP_SNAPSHOT_AUTO_STEPS, as there)."""
    budget = 0.5
    got = bench(procs, tmp_path, "cuda_step", "--device", "cpu", "--gb", "0.02", "--width", "256", "--batch", "64",
                "--blocks", "2", "--steps-per-block", "3", "--budget", str(budget), timeout=150,
                env={"DP_SNAPSHOT_AUTO_STEPS": "1,4"})
    assert got["device"] == "cpu" and got["state_bytes"] > 0
    assert set(got["step_s"]) == {"off", "per_step"} and got["ratio"] == pytest.approx(
        got["step_s"]["per_step"] / got["step_s"]["off"])
    assert got["profile"]["captures"] >= 3 + 3 * 2  # warm-up's 3 and 2 blocks of 3 steps, then auto's
    auto = got["auto"]
    assert auto["interval"] >= 1 and auto["overhead_estimate"] <= budget + 1e-9 and auto["decision"].startswith("auto:")
    assert set(auto["mean_step_s"]) == {"off", "auto"} and auto["overhead_measured"] == pytest.approx(
        auto["mean_step_s"]["auto"] / auto["mean_step_s"]["off"] - 1)
    assert auto["lag_steps"] >= 0 and auto["max_lost_steps"] == 2 * auto["interval"]  # acks at snapshot steps
    skipped = bench(procs, tmp_path, "cuda_step", json_name="skipped")
    assert skipped["device"] is None and skipped["skipped"] == "no CUDA device"


@pytest.mark.timeout(600)
def test_parallel_quick(procs, tmp_path):
    """The sharded / 3D-parallel benchmark on its smoke layout (2 nodes x 2, pp 2 dp 1 tp 2), its recovery and
    mesh parts (the overhead and memory parts take as long again; docs/performance.md has their figures): every
    figure measured (a number, not a 0 or None standing in for a run that failed), 3D and DDP side by side."""
    got = bench(procs, tmp_path, "parallel", "--quick", "--parts", "mesh,recovery", timeout=540)
    assert got["failed"] == [], got["failed"]
    rec = got["recovery"]
    for kind in ("3d", "ddp"):
        assert set(rec["phases"][kind]) == {"detect_s", "decide_s", "rebuild_s", "restore_s", "total_s"}, rec
        assert all(isinstance(v, float) and v >= 0 for v in rec["phases"][kind].values()), rec["phases"]
        assert rec["total_s"][kind] > 0 and rec["phases"][kind]["rebuild_s"] > 0
        assert rec["state_bytes_per_node"][kind] > 0 and rec["snapshot_bytes_per_node"][kind] > 0
    assert rec["ratio_total_3d_over_ddp"] == pytest.approx(rec["total_s"]["3d"] / rec["total_s"]["ddp"])
    assert 0.5 < rec["state_match"] < 2, rec["state_match"]  # the DDP model holds about the 3D job's state per node
    assert rec["build_s"]["survivors_max"] > 0 and rec["build_s"]["spare"] > 0
    assert 0 < rec["build_share_of_rebuild"] <= 1.05
    assert all(v is not None for v in rec["rebuild_steps_s"]["survivors_max"].values()), rec["rebuild_steps_s"]
    mesh = got["mesh_rebuild"]
    assert len(mesh["per_generation"]) == mesh["generations"] == 3
    assert mesh["median_s"] > 0 and mesh["max_s"] >= mesh["median_s"]
    assert all(v > 0 for v in mesh["phases_median_of_max_s"].values()), mesh


@pytest.mark.timeout(200)
def test_saving_quick(procs, tmp_path):
    """The background-save benchmark's smoke run: the throughputs and the overhead measured, the saves' bandwidth
    against a plain write of the same size into the same folder (--dir), and their ratio; the control run, a
    plain write of that size beside training."""
    got = bench(procs, tmp_path, "saving", "--quick", "--dir", str(tmp_path / "saves"), timeout=180)
    assert got["failed"] == [], got["failed"]
    assert set(got["throughput"]) == {"off", "save", "write", "buffered"}
    assert all(v and v > 0 for v in got["throughput"].values()), got["throughput"]
    assert isinstance(got["overhead"], float) and isinstance(got["overhead_target_met"], bool)
    assert got["save_mb_per_s"] > 0 and got["save_bytes"] > 0 and got["save_writers"] >= 1
    assert got["plain_mb_per_s"]["one_writer"] > 0 and got["plain_mb_per_s"]["n_writers"] > 0
    assert got["bandwidth_ratio"] == pytest.approx(got["save_mb_per_s"] / got["plain_mb_per_s"]["one_writer"])
    # the control: the same bytes written plainly beside a run without saves, its bandwidth and step cost
    assert got["beside"]["mb_per_s"] > 0 and got["beside"]["step_cost"]["saves"] >= 1, got["beside"]
    assert got["beside"]["bandwidth_ratio_beside"] == pytest.approx(got["save_mb_per_s"] / got["beside"]["mb_per_s"])
    # the same saves through the page cache (DP_SAVE_DIRECT=0), side by side
    assert got["buffered"]["mb_per_s"] > 0 and got["buffered"]["step_cost"]["saves"] >= 1, got["buffered"]
    assert all(got["plain_mb_per_s"][k] > 0 for k in ("direct_one", "buffered_one")), got["plain_mb_per_s"]
    assert not any((tmp_path / "saves").iterdir())  # the saves and plain writes are removed after


@pytest.mark.timeout(330)
def test_recovery_growth_quick(procs, tmp_path):
    """Recovery cost against the job's size (benchmarks/recovery_growth.py --quick): dprun jobs of 2 and 4 ranks
    that lose a node each, groups built alone in every variant, the controller alone; each phase measured, fitted
    against R and projected to 512 and 4,096 ranks."""
    got = bench(procs, tmp_path, "recovery_growth", "--quick", timeout=300)
    assert got["failed"] == [], got["failed"]
    assert [row["ranks"] for row in got["jobs"]] == [2, 4]
    for row in got["jobs"]:
        assert len(row["recoveries"]) == 1 and row["step_s"] > 0, row
        assert all(row[k] > 0 for k in ("detect_s", "decide_s", "rebuild_s", "restore_s", "total_s")), row
    assert {(g["ranks"], g["variant"]) for g in got["groups"]} == {(r, v) for r in (2, 4)
                                                                   for v in ("before", "table", "now", "lazy")}
    assert all(g["build_s"] > 0 and g["build_cpu_s"] > 0 and g["allreduce_s"] > 0 for g in got["groups"])
    assert got["store"]["server_cpu_per_get_s"] > 0 and all(d["decide_cpu_s"] > 0 for d in got["decide"])
    for name in ("job total_s", "job rebuild_s", "group build_cpu_s (now)", "controller decide_cpu_s"):
        assert set(got["fits"][name]["projected"]) == {"512", "4096"}, name
    assert got["projection"]["now"]["4096"]["total_s"] > got["projection"]["now"]["512"]["total_s"] > 0
    lazy = {g["ranks"]: g["connections_per_rank"] for g in got["groups"] if g["variant"] == "lazy"}
    full_mesh = {g["ranks"]: g["connections_per_rank"] for g in got["groups"] if g["variant"] == "now"}
    assert full_mesh == {2: 1, 4: 3} and 0 < lazy[4] <= 3, (lazy, full_mesh)


@pytest.mark.timeout(240)
def test_shrink_quick(procs, tmp_path):
    """The shrink benchmark's smoke run (2 nodes, one repetition): a hot swap, then a shrink and a grow of the same
    job, each detect -> first step measured and set against the hot swap's; steps/s at full and narrow width, the
    expected ratio beside the measured one; the printed tables read back."""
    code, text, out = run_bench(procs, tmp_path, "shrink", "--quick", timeout=220)
    assert code == 0, text[-4000:]
    got = json.loads(out.read_text())
    assert got["failed"] == [] and got["nnodes"] == 2, got["failed"]
    assert set(got["cost_s"]) == {"hotswap", "shrink", "grow"}
    for kind, cost in got["cost_s"].items():
        assert cost["detect_to_step_s"] > 0 and cost["total_s"] >= cost["detect_to_step_s"], (kind, cost)
    assert got["cost_s"]["grow"]["detect_s"] == 0  # a grow starts when the node registers: nothing to detect
    hot = got["cost_s"]["hotswap"]["detect_to_step_s"]
    for kind in ("shrink", "grow"):
        assert got["ratio"][f"{kind}_over_hotswap"] == pytest.approx(got["cost_s"][kind]["detect_to_step_s"] / hot)
    assert all(v > 0 for v in got["steps_per_s"].values()), got["steps_per_s"]
    assert got["narrow_over_full"] > 0 and got["expected"]["one_core_per_process"] == 0.5  # 2 ranks on 1 process
    (run,) = [r for r in got["runs"] if r["job"] == "shrink"]
    assert (run["ranks"], run["processes"], run["slowdown"]) == (2, 1, 2)
    # the printed output: one row per recovery, its ratio to the hot swap, and the throughput lines
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split()[:1] and line.split()[0] in got["cost_s"]}
    assert set(rows) == {"hotswap", "shrink", "grow"}
    for kind, cells in rows.items():
        assert float(cells[0]) == pytest.approx(got["cost_s"][kind]["detect_to_step_s"], abs=1e-3)
        assert float(cells[-1]) == pytest.approx(got["cost_s"][kind]["detect_to_step_s"] / hot, abs=0.01)
    assert f"narrow/full measured {got['narrow_over_full']:.2f}; expected 0.50" in text, text[-2000:]
