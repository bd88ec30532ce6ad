"""benchmarks/gpu.sh, the GPU checks that a lent GPU machine runs as it is, checked on this CPU host: it parses
(and is shellcheck-clean where shellcheck is installed); --print names every stage and its GPU command; the
summary turns each stage's JSON into figures and targets and names what a stage did not measure; without a
GPU the preflight fails and the rest is skipped, said, with exit 1; and (slow) the dry run goes through every
stage with tiny sizes on the CPU and writes a summary in which each has its status and figures."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu.sh"
STAGES = ["preflight", "cuda_step_2s", "cuda_step_67ms", "pipeline", "hotswap", "tests", "cuda_step_500ms"]

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_summary  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def gpu_sh(procs, out: Path, *args: str, timeout: float = 90, **env: str) -> tuple[int, str]:
    proc = procs.popen(["bash", str(SCRIPT), *args, str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.kill_all()
        text, _ = proc.communicate(timeout=30)
        raise AssertionError(f"gpu.sh did not finish in {timeout} s:\n{text[-4000:]}") from None
    return proc.returncode, text


def summary_of(out: Path) -> dict:
    got = json.loads((out / "summary.json").read_text())
    assert list(got["stages"]) == STAGES, got["stages"].keys()  # every stage, in the order run
    return got


@pytest.mark.slow  # starts bash (and shellcheck)
def test_the_script_parses_and_is_shellcheck_clean():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        res = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stdout


@pytest.mark.slow  # starts bash
def test_print_names_every_stage_with_its_gpu_command(procs, tmp_path):
    code, text = gpu_sh(procs, tmp_path / "out", "--print")
    assert code == 0, text
    got = summary_of(tmp_path / "out")
    assert got["ok"] and got["dry_run"] == "print" and got["targets"] == []
    stages = got["stages"]
    assert all(e["status"] == "printed" and e["timeout_s"] > 0 for e in stages.values()), stages
    assert max(e["timeout_s"] for e in stages.values()) <= 470  # none alone longer than the whole budget
    commands = {name: e["command"] for name, e in stages.items()}
    assert "tests/test_cuda_gpu.py" in commands["tests"] and "on_the_gpu_hot_swaps_its_spare" in commands["tests"]
    for name, step in (("cuda_step_2s", "2"), ("cuda_step_67ms", "0.067"), ("cuda_step_500ms", "0.5")):
        assert "--gb 4 " in commands[name] and f"--step-s {step} " in commands[name], commands[name]
        assert "--device cpu" not in commands[name]
    assert ("--no-auto" in commands["cuda_step_67ms"], "--no-auto" in commands["cuda_step_2s"]) == (False, True)
    assert "--device cuda" in commands["pipeline"] and "4000" in commands["pipeline"]
    assert "--nnodes 1 --spares 1" in commands["hotswap"] and "kill-node:0@step=" in commands["hotswap"]
    for name in STAGES:
        assert f"-- {name} (timeout" in text

    code, _ = gpu_sh(procs, tmp_path / "only", "--print", GPU_SH_ONLY="tests,hotswap")
    stages = summary_of(tmp_path / "only")["stages"]
    assert code == 0 and [n for n, e in stages.items() if e["status"] == "printed"] == ["hotswap", "tests"]
    assert {e["status"] for n, e in stages.items() if n not in ("tests", "hotswap")} == {"not_selected"}


@pytest.mark.slow  # starts bash
def test_out_of_time_stages_are_skipped_and_said(procs, tmp_path):
    """A budget too short for any stage: nothing runs, each stage says why, and the run exits 1."""
    code, text = gpu_sh(procs, tmp_path / "out", "--dry-run", GPU_SH_BUDGET_S="5")
    got = summary_of(tmp_path / "out")
    assert code == 1 and not got["ok"] and got["failed"] == STAGES, text
    assert all(e["status"] == "skipped" and e["reason"].startswith("out of time") for e in got["stages"].values())
    assert "NOT OK" in text


def write_stage(out: Path, name: str, index: int, status: str = "ok", rc: int = 0, cmd: str = "true",
                log: str = "") -> None:
    (out / "stages").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    (out / "stages" / f"{name}.status").write_text(f"status={status}\nrc={rc}\nindex={index}\nseconds=12.5\n"
                                                   f"reason={'' if rc == 0 else f'exit code {rc}'}\n")
    (out / "stages" / f"{name}.cmd").write_text(cmd + "\n")
    (out / "logs" / f"{name}.log").write_text(log)


def cuda_step_json(overhead: float, step: float, auto: dict | None = None) -> dict:
    return {"benchmark": "cuda_step", "device": "cuda:0", "device_name": "NVIDIA H200", "state_bytes": 4.03e9,
            "batch": 32768, "micro_batches": 9, "step_target_s": 2.0, "calibration": [],
            "step_s": {"off": step, "per_step": step * (1 + overhead)}, "ratio": 1 + overhead, "overhead": overhead,
            "profile": {"captures": 13, "bytes": 13 * 4.03e9, "copy_s": 1.3, "crc_s": 7.8, "sends": 13,
                        "send_s": 26.0, "waits": 20, "wait_s": 2.0}, "auto": auto}


def test_the_summary_sets_figures_against_the_targets_and_names_what_is_missing(tmp_path, capsys):
    """A GPU run's outputs, made up: figures and targets from each stage's JSON; a stage that exited 0 without
    its figures is incomplete (not a zero); a failed stage keeps the tail of its log; exit 1."""
    out = tmp_path
    (out / "stages").mkdir()
    (out / "stages" / "RUN").write_text("dry_run=0\nbudget_s=450\nstarted=1700000000.5\n")
    write_stage(out, "preflight", 0)
    (out / "preflight.json").write_text(json.dumps({"torch": "2.13.0", "device_name": "NVIDIA H200",
                                                    "device_memory_gb": 150.0, "cuda_available": True,
                                                    "modules": {"xdist": None}}))
    write_stage(out, "tests", 5, status="failed", rc=1, log="collected 6 items\nE   AssertionError: on cuda\n")
    (out / "tests.junit.xml").write_text(
        '<testsuites><testsuite tests="2"><testcase classname="tests.test_cuda_gpu" name="test_a" time="1.5"/>'
        '<testcase classname="tests.test_e2e_parallel" name="test_b" time="30"><failure message="on cuda"/>'
        "</testcase></testsuite></testsuites>")
    write_stage(out, "cuda_step_2s", 1, cmd="python benchmarks/cuda_step.py --gb 4 --step-s 2 --no-auto")
    (out / "cuda_step_2s.json").write_text(json.dumps(cuda_step_json(0.031, 2.05)))
    write_stage(out, "cuda_step_67ms", 2, cmd="python benchmarks/cuda_step.py --gb 4 --step-s 0.067")
    auto = {"interval": 52, "cost": 0.3, "cost_bound": 0.35, "lag_steps": 36.2, "overhead_estimate": 0.0098,
            "max_lost_steps": 104, "decision": "auto:0.01 every 52", "mean_step_s": {"off": 0.067, "auto": 0.0676},
            "overhead_measured": 0.012}
    (out / "cuda_step_67ms.json").write_text(json.dumps(cuda_step_json(33.0, 0.067, auto)))
    write_stage(out, "pipeline", 3)
    row = {"mb": 4000, "snapshot_s": 2.4, "restore_s": 2.3, "memcpy_GBps": 10.0, "tcp_GBps": 3.0, "d2h_GBps": 50.0,
           "h2d_GBps": 50.0, "copy_ratio": 0.8, "crc_ratio": 0.7, "pipeline_ratio": 1.4, "replicate_ratio": 0.9,
           "restore_ratio": 0.6, **{f"{k}_GBps": 2.0 for k in gpu_summary.PIPELINE_RATES}}
    (out / "pipeline.json").write_text(json.dumps({"device": "cuda", "sizes": [row], "failed": [], "skipped": []}))
    write_stage(out, "hotswap", 4, cmd="python -m dprun --nnodes 1 --spares 1 train_gpt.py --steps 40",
                log="train_gpt: 151M params, world 1, generation 0, on cpu\n")  # CUDA hidden: not a GPU figure
    (out / "hotswap").mkdir()
    (out / "hotswap" / "events.jsonl").write_text(json.dumps(
        {"event": "recovery_complete", "restore_step": 24, "lost_steps": 1, "generation": 1,
         "phases": {"detect_s": 0.05, "decide_s": 0.0, "rebuild_s": 0.3, "restore_s": 1.2, "total_s": 2.0}}) + "\n")
    (out / "hotswap" / "summary.json").write_text(json.dumps({"final_step": 40}))
    write_stage(out, "cuda_step_500ms", 6, cmd="python benchmarks/cuda_step.py --gb 4 --step-s 0.5 --no-auto")
    broken = cuda_step_json(0.5, 0.5)
    broken["step_s"]["off"] = 0.0  # a run that measured nothing must not read as a figure
    (out / "cuda_step_500ms.json").write_text(json.dumps(broken))

    assert gpu_summary.main(["summary", str(out), "--budget", "450", "--elapsed", "300"]) == 1
    report = capsys.readouterr().out
    got = json.loads((out / "summary.json").read_text())
    stages = got["stages"]
    assert [n for n, e in stages.items() if e["status"] == "ok"] == ["preflight", "cuda_step_2s", "cuda_step_67ms",
                                                                      "pipeline"]
    assert list(stages) == STAGES and got["failed"] == ["hotswap", "tests", "cuda_step_500ms"] and not got["ok"]
    assert stages["tests"]["figures"]["passed"] == 1 and stages["tests"]["figures"]["failed"] == 1
    assert "AssertionError: on cuda" in stages["tests"]["log_tail"] and stages["tests"]["rc"] == 1
    assert stages["hotswap"]["status"] == "incomplete" and stages["hotswap"]["figures"]["trained_on"] == "cpu"
    assert any("training on the GPU" in m for m in stages["hotswap"]["missing"])
    assert stages["cuda_step_500ms"]["status"] == "incomplete" and "step_s_off" in stages["cuda_step_500ms"]["missing"]
    assert stages["cuda_step_500ms"]["figures"]["step_s_off"] is None  # said missing, not written as 0
    figs = stages["cuda_step_2s"]["figures"]
    assert figs["copy_ms"] == pytest.approx(100) and figs["send_GBps"] == pytest.approx(2.015)
    targets = {t["stage"] + ":" + t["target"][:12]: t for t in got["targets"]}
    per_step = targets["cuda_step_2s:per-step sna"]
    assert per_step["value"] == pytest.approx(0.031) and per_step["met"] is True and per_step["state_gb"] == 4.03
    auto_t = targets["cuda_step_67ms:auto (deferr"]
    assert auto_t["met"] is False and auto_t["interval"] == 52 and auto_t["max_lost_steps"] == 104
    pipe = [t for t in got["targets"] if t["stage"] == "pipeline"]
    assert [t["met"] for t in pipe] == [False, True, False]  # 1.4x its slowest stage; 0.9 and 0.6 of TCP
    assert "all stages ok" not in report and "NOT OK: hotswap (incomplete), tests (failed)" in report
    assert "auto (deferred acks) at 67 ms steps costs <= 1 %: +1.2 % NOT met (interval 52" in report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_gpu_the_preflight_fails_and_every_other_stage_is_skipped(procs, tmp_path):
    code, text = gpu_sh(procs, tmp_path / "out", timeout=240)
    got = summary_of(tmp_path / "out")
    assert code == 1 and got["failed"] == STAGES, text
    pre = got["stages"]["preflight"]
    assert pre["status"] == "failed" and pre["rc"] == 3 and "torch sees no CUDA device" in pre["log_tail"]
    assert json.loads((tmp_path / "out" / "preflight.json").read_text())["problems"] == ["torch sees no CUDA device"]
    assert all(got["stages"][n]["status"] == "skipped" and "preflight failed" in got["stages"][n]["reason"]
               for n in STAGES[1:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dry_run_goes_through_every_stage_on_the_cpu(procs, tmp_path):
    """Every stage's command with tiny sizes on the CPU (about a minute on a quiet host): each ends ok with the
    figures it should have, the targets are there (marked as a dry run's), nothing is left running. Its pipeline
    stage is also the smoke run of scaling.py's part 1 (10 MB, 2 repetitions), checked here in full."""
    out = tmp_path / "out"
    code, text = gpu_sh(procs, out, "--dry-run", timeout=840, GPU_SH_BUDGET_S="800")
    got = summary_of(out)
    assert code == 0 and got["ok"], text[-6000:]
    stages = got["stages"]
    assert all(e["status"] == "ok" and "missing" not in e and e["seconds"] > 0 for e in stages.values()), stages
    assert stages["tests"]["figures"]["collected"] == 6  # all skipped here (no CUDA): the selection is right
    for name in ("cuda_step_2s", "cuda_step_67ms", "cuda_step_500ms"):
        figs = stages[name]["figures"]
        assert figs["device"] == "cpu" and figs["step_s_off"] > 0 and figs["copy_ms"] > 0, figs
        assert json.loads((out / f"{name}.json").read_text())["calibration"], name  # --step-s fitted the rows
    assert stages["cuda_step_67ms"]["figures"]["auto_interval"] >= 1
    assert stages["pipeline"]["figures"]["sizes"][0]["copy_GBps"] > 0
    # scaling.py's part 1 on the CPU (tests/test_benchmarks.py runs its part 2): every figure of the size's row
    (row,) = json.loads((out / "pipeline.json").read_text())["sizes"]
    for key in ("capture_s", "replicate_s", "restore_s", "capture_ratio", "replicate_ratio", "restore_ratio",
                "replicate_s_cold", "restore_s_cold", "replicate_cold_ratio", "restore_cold_ratio"):
        assert row[key] > 0, key
    hot = stages["hotswap"]["figures"]
    assert hot["total_s"] > 0 and hot["final_step"] == 16 and hot["spare_promoted"] and hot["trained_on"] == "cpu"
    assert len(got["targets"]) == 5 and all(t["value"] is not None for t in got["targets"])
    assert all("dry run" in t["note"] for t in got["targets"])
    assert "all stages ok" in text
