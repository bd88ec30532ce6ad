"""The dprun command line as a user meets it: --help everywhere, torchrun's flag names, and every bad input
answered with one line on stderr and a non-zero exit (real `python -m dprun` processes, run side by side)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(90)

TORCHRUN_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--standalone",
                  "--max-restarts", "--monitor-interval", "--log-dir", "-r, --redirects", "-t, --tee",
                  "--local-ranks-filter", "-m, --module", "--no-python", "--local-addr", "--master-addr",
                  "--master-port", "--rdzv-backend")


def start(args, cwd, env=None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    full_env.update({"COLUMNS": "100", "DPRUN_STATE_DIR": str(cwd / "state"), **(env or {})})
    return subprocess.Popen([sys.executable, "-m", "dprun", *map(str, args)], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish_all(procs: list[subprocess.Popen], timeout: float = 60) -> list[tuple[int, str, str]]:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_help_for_every_command_and_torchrun_flag(tmp_path):
    runs = finish_all([start(a, tmp_path) for a in (["--help"], ["-h"], ["status", "--help"], ["report", "--help"])])
    assert [code for code, _, _ in runs] == [0, 0, 0, 0], runs
    (_, run_help, _), (_, short_help, _), (_, status_help, _), (_, report_help, _) = runs
    assert run_help == short_help
    for flag in TORCHRUN_FLAGS + ("--spares", "--recovery", "--tui / --no-tui", "--status-port", "--inject",
                                  "PET_NNODES", "dprun status", "dprun report"):
        assert flag in run_help, flag
    assert "--endpoint" in status_help and "--once" in status_help and "--json" in status_help
    assert "--plot" in report_help and "EVENTS.jsonl" in report_help


def test_every_bad_input_gets_one_line_and_a_nonzero_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    token = tmp_path / "token"
    token.write_text("secret")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = {
        "unknown flag": (["--no-such-flag", script], "no such option: --no-such-flag"),
        "no script": ([], "missing argument 'SCRIPT'"),
        "missing script": (["missing.py"], "no such script: missing.py"),
        "bad inject": (["--inject", "explode:1@step=3", script], "unknown kind 'explode'"),
        "inject spec": (["--inject", "kill-node", script], "bad --inject"),
        "step fault, plain script": (["--inject", "kill-worker:0@step=5", script],
                                     "does not use dpstate, so dprun does not see its steps; trigger it at a time"),
        "zero nodes": (["--nnodes", "0", script], "--nnodes must be at least 1"),
        "elastic nodes": (["--nnodes", "1:4", script], "elastic node counts are not supported"),
        "replicas": (["--nnodes", "2", "--replicas", "2", script], "--replicas 2 needs 3 nodes or more"),
        "nproc": (["--nproc-per-node", "many", script], "--nproc-per-node must be"),
        "redirects": (["-r", "7", script], "bad --redirects '7'"),
        "ranks filter": (["--local-ranks-filter", "a,b", script], "bad --local-ranks-filter"),
        "recovery": (["--recovery", "maybe", script], "--recovery must be one of"),
        "controller lost": (["--on-controller-lost", "panic", script], "--on-controller-lost must be 'cancel' or"),
        "requeue, no save": (["--on-controller-lost", "requeue", script], "requeue needs --save-dir"),
        "snapshot check": (["--snapshot-check", "0", script], "--snapshot-check must be a positive number"),
        "log dir": (["--log-dir", script / "logs", script], f"--log-dir {script / 'logs'}: Not a directory"),
        "events file": (["--events-file", tmp_path / "no" / "e.jsonl", script],
                        f"--events-file {tmp_path / 'no' / 'e.jsonl'}: No such file or directory"),
        "endpoint": (["--rdzv-endpoint", "nohostport", "--token-file", token, script], "expected HOST:PORT"),
        "no program": (["--no-python", "no-such-program-xyz"], "no such command: no-such-program-xyz"),
        "node rank, no endpoint": (["--nnodes", "2", "--node-rank", "1", script],
                                   "--node-rank 1 is one node of a multi-node job: give every node --rdzv-endpoint"),
        "port in use": (["--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "0", "--token-file", token, script],
                        f"cannot listen on 127.0.0.1:{port}"),
        "status port in use": (["--status-port", port, script], f"cannot listen on 127.0.0.1:{port}"),
        "status endpoint": (["status", "--endpoint", "nowhere"], "bad --endpoint"),
        "status no job": (["status"], "no running job found"),
        "report file": (["report", "missing.jsonl"], "cannot read missing.jsonl"),
        "report empty": (["report", script], "holds no events"),
    }
    step = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]"}
    env_cases = {"PET_NNODES": ({"PET_NNODES": "0"}, "--nnodes must be at least 1"),
                 "PET_NPROC_PER_NODE": ({"PET_NPROC_PER_NODE": "lots"}, "--nproc-per-node must be"),
                 "srun -n4 -N2": ({**step, "SLURM_STEP_NUM_TASKS": "4"}, "dprun runs once per node"),
                 "srun -N2, --nnodes 3": ({**step, "SLURM_STEP_NUM_TASKS": "2", "PET_NNODES": "3"},
                                          "the Slurm step has 2 node(s), fewer than --nnodes 3")}
    try:
        procs = [start(args, tmp_path) for args, _ in cases.values()]
        procs += [start([script], tmp_path, env) for env, _ in env_cases.values()]
        results = finish_all(procs)
    finally:
        busy.close()
    expected = [want for _, want in cases.values()] + [want for _, want in env_cases.values()]
    for name, (code, out, err), want in zip([*cases, *env_cases], results, expected):
        lines = err.strip().splitlines()
        assert code == 2, (name, code, err)
        assert len(lines) == 1 and lines[0].startswith("dprun"), (name, err)
        assert want in lines[0], (name, lines[0])
        assert "Traceback" not in out + err, name


def test_dprun_in_a_batch_script_runs_on_its_node_and_says_so(tmp_path):
    """Not started by srun (sbatch's script, an salloc shell): SLURM_NODEID=0 and a job of 2 nodes do not make
    it node 0 of 2 waiting for a second dprun; it runs its job here and says how to use every node."""
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    batch = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    ((code, out, err),) = finish_all([start(["--nnodes", "1", script], tmp_path, batch)])
    assert code == 0, err
    assert "trained" in out
    assert "Slurm job 7 has 2 nodes but this dprun was not started by srun" in err


@pytest.mark.parametrize("where", ["given", "slurm"])
def test_an_endpoint_host_that_does_not_resolve_is_one_line(where, tmp_path, monkeypatch):
    """The endpoint's host is looked up before anything starts. Here a resolver that knows no host stands in
    for DNS (a real lookup of an unknown name would leave loopback): under srun the first node's NodeName may
    not resolve where the address does, and the message says to give the address."""
    from typer.testing import CliRunner

    from dprun.cli import app

    def no_such_host(*_args, **_kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    env = {"DP_JOB_TOKEN": "secret"}
    args = ["--nnodes", "2", str(script)]
    if where == "given":
        args = ["--rdzv-endpoint", "head-node:29400", *args]
        want = "dprun: --rdzv-endpoint: cannot resolve 'head-node'"
    else:
        env.update({"SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]"})
        want = ("dprun: cannot resolve n1, the Slurm step's first node: pass --rdzv-endpoint ADDRESS:PORT with its "
                "address, the same on every node")
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == want
