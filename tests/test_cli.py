"""The dprun command line as a user meets it: --help everywhere, torchrun's flag names, and every bad input
answered with one line on stderr and a non-zero exit. The checks run dprun.cli.main(argv) in this process (each
real `python -m dprun` took ~4 s, most of it importing); test_the_real_entry_point_says_what_main_says runs real
processes side by side and finds them saying the same, and holds the cases that bind a port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from helpers.cli import environment, in_process

pytestmark = pytest.mark.timeout(90)

TORCHRUN_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--standalone",
                  "--max-restarts", "--monitor-interval", "--log-dir", "-r, --redirects", "-t, --tee",
                  "--local-ranks-filter", "-m, --module", "--no-python", "--local-addr", "--master-addr",
                  "--master-port", "--rdzv-backend")


def start(args, cwd, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dprun", *map(str, args)], cwd=cwd, env=environment(cwd, env),
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
    runs = [in_process(a, tmp_path) for a in (["--help"], ["-h"], ["status", "--help"], ["report", "--help"])]
    assert [code for code, _, _ in runs] == [0, 0, 0, 0], runs
    (_, run_help, _), (_, short_help, _), (_, status_help, _), (_, report_help, _) = runs
    assert run_help == short_help
    for flag in TORCHRUN_FLAGS + ("--spares", "--recovery", "--tui / --no-tui", "--status-port", "--inject",
                                  "PET_NNODES", "dprun status", "dprun report"):
        assert flag in run_help, flag
    assert "--endpoint" in status_help and "--once" in status_help and "--json" in status_help
    assert "--plot" in report_help and "EVENTS.jsonl" in report_help


def bad_inputs(folder, port: int) -> dict[str, tuple[list, dict | None, str]]:
    """Every bad input of a job's command line, by name: (arguments, environment added, what the line says).
    `port`: one that something on this machine listens on."""
    script = folder / "train.py"
    script.write_text("print('never runs')\n")
    token = folder / "token"
    token.write_text("secret")
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
        "events file": (["--events-file", folder / "no" / "e.jsonl", script],
                        f"--events-file {folder / 'no' / 'e.jsonl'}: No such file or directory"),
        "endpoint": (["--rdzv-endpoint", "nohostport", "--token-file", token, script], "expected HOST:PORT"),
        "no program": (["--no-python", "no-such-program-xyz"], "no such command: no-such-program-xyz"),
        "node rank, no endpoint": (["--nnodes", "2", "--node-rank", "1", script],
                                   "--node-rank 1 is one node of a multi-node job: give every node --rdzv-endpoint"),
        "port in use": (["--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "0", "--token-file", token, script],
                        f"cannot listen on 127.0.0.1:{port} (address already in use: another job's controller"),
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
    return {**{name: (args, None, want) for name, (args, want) in cases.items()},
            **{name: ([script], env, want) for name, (env, want) in env_cases.items()}}


# these start a job's controller or status feed in the process, which fails to bind: real processes only
BINDS_A_PORT = ("port in use", "status port in use")
# and these, run both ways, show that the entry point (python -m dprun) says what main(argv) says: a usage error
# of the command line parser, a check of the job's options, an environment variable, a subcommand
ON_BOTH_SIDES = ("unknown flag", "zero nodes", "PET_NNODES", "status endpoint", "report empty")


def one_line(name, code: int, out: str, err: str, want: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (name, code, err)
    assert len(lines) == 1 and lines[0].startswith("dprun"), (name, err)
    assert want in lines[0], (name, lines[0])
    assert "Traceback" not in out + err, name


@pytest.fixture
def busy_port():
    """A port that something listens on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def test_every_bad_input_gets_one_line_and_a_nonzero_exit(tmp_path, busy_port):
    for name, (args, env, want) in bad_inputs(tmp_path, busy_port).items():
        if name not in BINDS_A_PORT:
            one_line(name, *in_process(args, tmp_path, env), want)


@pytest.mark.slow  # starts `python -m dprun` processes
def test_the_real_entry_point_says_what_main_says(tmp_path, busy_port):
    """`python -m dprun` processes, side by side: --help and a sample of the bad inputs end as main(argv) ends in
    this process, to the byte; the inputs that bind a port get their one line too."""
    cases = bad_inputs(tmp_path, busy_port)
    names = [*ON_BOTH_SIDES, *BINDS_A_PORT]
    runs = finish_all([start(["--help"], tmp_path), *[start(cases[n][0], tmp_path, cases[n][1]) for n in names]])
    help_run, *runs = runs
    assert help_run == in_process(["--help"], tmp_path)
    for name, (code, out, err) in zip(names, runs):
        one_line(name, code, out, err, cases[name][2])
        if name in ON_BOTH_SIDES:
            assert (code, out, err) == in_process(cases[name][0], tmp_path, cases[name][1]), name


@pytest.mark.slow  # starts a `python -m dprun` process
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


@pytest.fixture
def inputs(tmp_path):
    """A folder of things to give dprun: scripts (one that uses dpstate), a token file that is not text, a
    folder and a shell script without its executable bit."""
    (tmp_path / "plain.py").write_text("print('never runs')\n")
    (tmp_path / "uses_dpstate.py").write_text("import dpstate  # never runs\n")
    (tmp_path / "badtok").write_bytes(b"\xff\xfe\x80")
    (tmp_path / "adir").mkdir()
    for name, mode in (("s.sh", 0o644), ("ok.sh", 0o755)):
        (tmp_path / name).write_text("#!/bin/sh\necho never runs\n")
        (tmp_path / name).chmod(mode)
    return tmp_path


def one_line_exit_2(args, cwd, want: str, env=None) -> str:
    """dprun ARGS ends at once with exit code 2 and one line on stderr that holds `want`, no traceback (main(argv)
    in this process: test_the_real_entry_point_says_what_main_says shows a process says the same)."""
    code, out, err = in_process(args, cwd, env)
    one_line(args, code, out, err, want)
    return err.strip()


TIME_FLAGS = ("--heartbeat-interval", "--heartbeat-timeout", "--probe-timeout", "--hang-timeout",
              "--monitor-interval", "--spare-wait-timeout", "--rdzv-timeout")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
@pytest.mark.parametrize("flag", TIME_FLAGS + ("status --timeout",))
def test_times_must_be_finite_and_positive(flag, value, inputs):
    """nan would never time out (a frozen node never noticed), negatives and inf make no sense; 0 is --hang-timeout's
    off."""
    command, _, flag = flag.rpartition(" ")
    args = [*command.split(), flag, value] + ([] if command else ["plain.py"])
    if flag == "--hang-timeout" and value == "0":  # accepted: the next check (the status port) speaks instead
        one_line_exit_2([*args[:-1], "--status-port", "70000", "plain.py"], inputs, "--status-port must be a port")
        return
    wanted = "0 or more" if flag == "--hang-timeout" else "more than 0"
    line = one_line_exit_2(args, inputs, f"{flag} must be a number of seconds, {wanted} (not nan or inf), got ")
    assert line.startswith("dprun status: " if command else "dprun: "), line


def test_heartbeat_timeout_must_exceed_the_interval(inputs):
    one_line_exit_2(["--heartbeat-interval", "2", "--heartbeat-timeout", "1", "plain.py"], inputs,
                    "--heartbeat-timeout 1 must be larger than --heartbeat-interval 2")


@pytest.mark.parametrize("spec", ["auto:0%", "auto:0", "auto:0.0", "auto:500%", "auto:100%", "auto:1.5", "auto:1"])
def test_a_snapshot_budget_outside_0_to_1_is_refused_up_front(spec, inputs):
    one_line_exit_2(["--snapshot-interval", spec, "uses_dpstate.py"], inputs,
                    f"--snapshot-interval {spec}: the budget is the share of step time that snapshots may cost, "
                    "more than 0 and less than 1")


@pytest.mark.parametrize("spec", ["off", "1", "25", "auto", "auto:0.02", "auto:.5", "auto:0.999", "auto:2%",
                                  "auto:99.9%", "auto:0.0001%", "auto:0", "auto:1", "auto:0%", "auto:100%",
                                  "auto:1.5", "auto:500%", "auto:00.5", "auto:1.0"])
def test_the_cli_takes_the_snapshot_budgets_that_workers_take(spec):
    """What dprun accepts, every worker's dpstate.steps.interval accepts too (and what the workers refuse, dprun
    does)."""
    from dprun.launcher.option_checks import snapshot_interval_problem
    from dpstate.steps.interval import SnapshotPolicy

    try:
        SnapshotPolicy(spec, budget="")
        worker_takes = True
    except ValueError:
        worker_takes = False
    assert (snapshot_interval_problem(spec) is None) == worker_takes, spec


def test_a_token_file_that_is_not_text_is_one_line(inputs):
    one_line_exit_2(["--token-file", "badtok", "plain.py"], inputs,
                    "--token-file badtok is not text (UTF-8): write the secret as text")


BIG = "99999999999999999999"


@pytest.mark.parametrize("args, want", [
    (["--nnodes", BIG], f"--nnodes {BIG} + --spares 0 is too many for one machine: at most 256"),
    (["--spares", BIG], f"--nnodes 1 + --spares {BIG} is too many for one machine: at most 256"),
    (["--nnodes", "200", "--spares", "57"], "--nnodes 200 + --spares 57 is too many for one machine: at most 256"),
    (["--nproc-per-node", BIG], f"--nproc-per-node {BIG} is too many: at most 1024 workers per node"),
    (["--nproc-per-node", "100000"], "--nproc-per-node 100000 is too many: at most 1024 workers per node"),
    (["--nnodes", "4", "--nproc-per-node", "257"], "is 1028 workers, too many for one machine: at most 1024"),
    (["--nnodes", "100001", "--rdzv-endpoint", "127.0.0.1:29499"],
     "--nnodes 100001 is too many: at most 100000 in a multi-node job"),
    (["--nnodes", BIG, "--rdzv-endpoint", "127.0.0.1:29499"], f"--nnodes {BIG} is too many: at most 100000"),
], ids=["nnodes", "spares", "local nodes", "nproc overflow", "nproc", "local workers", "multi-node", "huge"])
def test_job_sizes_have_upper_bounds(args, want, inputs):
    one_line_exit_2([*args, "plain.py"], inputs, want, env={"DP_JOB_TOKEN": "secret"})


def test_the_size_bounds_let_the_largest_jobs_through():
    from dprun.launcher.option_checks import MAX_LOCAL_NODES, MAX_NODES, MAX_NPROC_PER_NODE, counts_problem

    assert counts_problem(MAX_LOCAL_NODES - 2, 2, 4, standalone=True) is None  # 256 x 4 = 1024 workers
    assert counts_problem(1, 0, MAX_NPROC_PER_NODE, standalone=True) is None
    assert counts_problem(MAX_NODES, MAX_NODES, MAX_NPROC_PER_NODE, standalone=False) is None
    assert counts_problem(MAX_LOCAL_NODES, 1, 1, standalone=True) is not None
    assert counts_problem(1, 0, MAX_NPROC_PER_NODE + 1, standalone=False) is not None


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_the_status_port_is_a_port(port, inputs):
    one_line_exit_2(["--status-port", port, "plain.py"], inputs,
                    f"--status-port must be a port from 1 to 65535, or 0 for any free one, got {port}")


@pytest.mark.parametrize("rdzv_id", ["../../escape", "..", ".", "a/b", "job 1", "/abs"])
def test_a_job_id_is_one_plain_name(rdzv_id, inputs):
    """The id names the job's folder under --log-dir: one that climbs out of it is refused."""
    one_line_exit_2(["--rdzv-id", rdzv_id, "--log-dir", "logs", "plain.py"], inputs,
                    f"--rdzv-id {rdzv_id!r}: use only letters, digits, '.', '_' and '-'")
    assert not (inputs.parent / "escape").exists() and not (inputs / "logs").exists()


def test_a_plain_job_id_passes(inputs):
    one_line_exit_2(["--rdzv-id", "job-1.a_B", "missing.py"], inputs, "no such script: missing.py")


@pytest.mark.parametrize("command, want", [
    ("./nope.sh", "no such command: ./nope.sh (No such file or directory)"),
    ("./s.sh", "./s.sh is not executable: chmod +x ./s.sh"),
    ("./adir", "./adir is a directory, not a command"),
])
def test_a_command_with_a_path_must_be_an_executable_file(command, want, inputs):
    one_line_exit_2(["--no-python", command], inputs, want)


def test_an_executable_command_passes(inputs):
    one_line_exit_2(["--no-python", "--snapshot-interval", "auto:0", "./ok.sh"], inputs, "--snapshot-interval auto:0")


def test_a_folder_given_as_the_script_is_named_so(inputs):
    one_line_exit_2(["adir"], inputs, "adir is a directory, not a script")


@pytest.mark.skipif(not os.path.isdir("/proc/1"), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--save-dir", "--log-dir"])
def test_a_folder_nobody_can_write_is_refused_up_front(flag, inputs):
    line = one_line_exit_2([flag, "/proc/1", "uses_dpstate.py"], inputs, f"{flag} /proc/1: cannot write there (")
    assert line.endswith("); give a folder every node can write"), line


def test_the_write_probe_leaves_nothing_behind(inputs):
    one_line_exit_2(["--save-dir", "saved", "--log-dir", "logs", "--token-file", "badtok", "uses_dpstate.py"],
                    inputs, "--token-file badtok is not text")
    assert list((inputs / "saved").iterdir()) == [] and list((inputs / "logs").iterdir()) == []


def test_a_multi_node_job_without_a_token_is_bad_input(inputs):
    """run_multinode would refuse it too, but with exit code 1: dprun says the same before, with 2."""
    line = one_line_exit_2(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29499", "--node-rank", "0", "plain.py"],
                           inputs, "", env={"DP_JOB_TOKEN": ""})
    assert line == ("dprun: multi-node mode needs the job's secret: --token-file FILE (the same file on every node) "
                    "or DP_JOB_TOKEN in the environment")


def test_help_shows_percent_signs_once(tmp_path):
    code, out, err = in_process(["--help"], tmp_path)
    assert code == 0, err
    assert "%%" not in out
    assert "under 1% of step time; auto:0.02 for 2%)" in " ".join(out.split())  # (wrapped at any width)


@pytest.mark.parametrize("args, want", [
    (["--local-addr", "999.1.1.1"], "--local-addr 999.1.1.1: this machine cannot listen there"),
    (["--local-addr", "192.0.2.77"], "--local-addr 192.0.2.77: this machine cannot listen there"),  # (TEST-NET-1)
    (["--rdzv-endpoint", "[::1]:29564", "--node-rank", "0"], "IPv6 addresses are not supported yet"),
    (["--on-spare-exhausted", "wait"], "a standalone job cannot take"),
    (["--save-dir", "saved", "--snapshot-interval", "off"], "--snapshot-interval off takes none"),
    (["--node-rank", "-5"], "--node-rank must be 0 or more (or left out), got -5"),
], ids=["bad address", "not this machine's", "ipv6", "wait alone", "save without snapshots", "negative rank"])
def test_options_that_cannot_work_here_or_together_are_refused_up_front(args, want, inputs):
    """Before: the agent of a head with a --local-addr not its own failed at once while the controller waited
    --rdzv-timeout (300 s) for it; [::1] was said to be a port in use; a standalone job waited 30 minutes for a
    spare that nothing could start; a save with nothing to save; a negative rank taken for 'auto'."""
    one_line_exit_2([*args, "uses_dpstate.py"], inputs, want, env={"DP_JOB_TOKEN": "secret"})


def test_a_local_address_of_this_machine_passes():
    from dprun.launcher.option_checks import local_addr_problem

    assert local_addr_problem("127.0.0.1") is None and local_addr_problem("localhost") is None
    assert local_addr_problem(None) is None

