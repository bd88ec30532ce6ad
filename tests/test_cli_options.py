"""dprun's command line made into its job's options (dprun.launcher.run_options.options_from_args), in this process and
with no process started: good input gives a frozen JobOptions and the notices to print; each bad input an
OptionsError holding its one line. (test_cli runs the same through the command line.)"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from dprun.launcher.job import JobOptions, _worker_settings
from dprun.launcher.run_options import OptionsError, RunArgs, options_from_args

pytestmark = pytest.mark.timeout(30)

TOKEN = {"DP_JOB_TOKEN": "secret"}
STEP = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.2"}  # srun -N2


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A plain torchrun script, one that uses dpstate, an empty token file and a file to put folders under."""
    (tmp_path / "plain.py").write_text("print('never runs')\n")
    (tmp_path / "hot.py").write_text("import dpstate  # never runs\n")
    (tmp_path / "empty-token").write_text("\n")
    (tmp_path / "a-file").write_text("")
    return tmp_path


def options(folder: Path, script: str = "hot.py", env: dict[str, str] | None = None, terminal: bool = False,
            **given) -> tuple[JobOptions, list[str]]:
    return options_from_args(RunArgs(script=str(folder / script), **given), env or {}, terminal)


def test_a_standalone_job_gets_its_options_checked_and_frozen(files):
    job, notices = options(files, "plain.py", script_args=("--steps", "5"), nnodes="2:2", spares=1,
                           nproc_per_node="3", inject=("kill-node:1@t=2",), events_file=files / "events.jsonl")
    assert notices == []
    assert (job.nnodes, job.spares, job.nproc_per_node) == (2, 1, 3)
    assert job.script == (str(files / "plain.py"), "--steps", "5")
    assert job.restart_mode and job.rdzv_endpoint is None and job.token is None and job.slurm is None
    assert [str(fault) for fault in job.faults] == ["kill-node:1@t=2"]
    assert job.events_file == str(files / "events.jsonl") and (files / "events.jsonl").is_file()
    assert (job.heartbeat_interval, job.heartbeat_timeout, job.hang_timeout) == (0.5, 5.0, 600.0)
    assert not job.tui  # stdout is not a terminal here, and --tui was not given
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.nnodes = 3  # type: ignore[misc]


def test_words_and_defaults_are_read_as_torchrun_and_dprun_read_them(files):
    job, _ = options(files, nproc_per_node="cpu", recovery="hot-swap", monitor_interval=2.0, terminal=True)
    assert job.nproc_per_node == (os.cpu_count() or 1) and not job.restart_mode and job.tui
    assert (job.heartbeat_interval, job.heartbeat_timeout) == (2.0, 20.0)  # 10 intervals at least
    assert options(files, "plain.py", recovery="auto")[0].restart_mode  # auto: the script's source decides
    assert not options(files, "hot.py", tui=False)[0].tui
    job, _ = options(files, save_dir=files / "saved", save_every=10, save_interval="2h", save_keep=3)
    assert (job.save_dir, job.save_every, job.save_interval, job.save_keep) == (str(files / "saved"), 10, 7200.0, 3)
    assert (files / "saved").is_dir() and list((files / "saved").iterdir()) == []  # probed, nothing left behind


def test_snapshot_settings_reach_the_workers_through_the_options_not_this_environment(files):
    before = dict(os.environ)
    job, _ = options(files, snapshot_interval=" AUTO:2% ", snapshot_check="FULL")
    assert dict(os.environ) == before
    assert (job.snapshot_interval, job.snapshot_check) == ("auto:2%", "full")
    settings = _worker_settings(job)  # what dprun.launcher.job adds to its agents' (and so their workers') environment
    assert settings["DP_SNAPSHOT_INTERVAL"] == "auto:2%" and settings["DP_SNAPSHOT_CHECK"] == "full"
    plain, _ = options(files)
    assert "DP_SNAPSHOT_INTERVAL" not in _worker_settings(plain)  # not given: the workers' own, or every step
    assert "DP_SNAPSHOT_CHECK" not in _worker_settings(plain)


def test_a_multi_node_job_takes_its_endpoint_token_and_torchrun_spelling(files):
    job, _ = options(files, nnodes="2", node_rank=0, master_addr="127.0.0.1", env=TOKEN)
    assert (job.rdzv_endpoint, job.node_rank, job.token) == ("127.0.0.1:29500", 0, "secret")
    (files / "token").write_text("from-file\n")
    job, _ = options(files, nnodes="2", rdzv_endpoint="127.0.0.1:29400", token_file=files / "token", env=TOKEN)
    assert job.rdzv_endpoint == "127.0.0.1:29400" and job.token == "from-file"
    # torchrun's single node `--master-port P`: this machine, no token needed
    job, _ = options(files, master_addr="localhost", master_port=29401)
    assert job.rdzv_endpoint is None


def test_an_srun_step_gives_the_node_rank_endpoint_id_and_spares(files):
    job, notices = options(files, env={**STEP, **TOKEN})
    assert notices == []
    assert (job.rdzv_endpoint, job.node_rank, job.rdzv_id, job.spares) == ("127.0.0.1:10007", 1, "slurm-7", 1)
    assert job.slurm is not None and job.slurm.step_nodes == ("127.0.0.1", "127.0.0.2")
    assert options(files, env=STEP | TOKEN, standalone=True)[0].slurm is None  # --standalone: Slurm ignored


def test_notices_are_returned_to_print_not_printed(files, capsys):
    batch = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    job, notices = options(files, redirects="3", env=batch)
    try:
        assert job.log_dir is not None and Path(job.log_dir).is_dir()
        assert notices[0] == f"-r/-t without --log-dir: the logs go to {job.log_dir}"
        assert notices[1].startswith("Slurm job 7 has 2 nodes but this dprun was not started by srun")
        assert len(notices) == 2
        assert capsys.readouterr() == ("", "")
    finally:
        shutil.rmtree(job.log_dir or "", ignore_errors=True)


def bad_inputs(folder: Path) -> dict[str, tuple[dict, dict, str]]:
    """By name: (RunArgs fields, environment, the whole line said)."""
    plain = str(folder / "plain.py")
    return {
        "nnodes": ({"nnodes": "two"}, {}, "--nnodes must be a whole number, got 'two'"),
        "elastic": ({"nnodes": "1:4"}, {}, "--nnodes 1:4: elastic node counts are not supported; DeadPool keeps "
                                           "--nnodes fixed and replaces failed nodes from --spares"),
        "no nodes": ({"nnodes": "0"}, {}, "--nnodes must be at least 1, got 0"),
        "spares": ({"spares": -1}, {}, "--spares must be 0 or more, got -1"),
        "nproc": ({"nproc_per_node": "many"}, {},
                  "--nproc-per-node must be a whole number, auto, cpu or gpu, got 'many'"),
        "no workers": ({"nproc_per_node": "0"}, {}, "--nproc-per-node must be at least 1, got 0"),
        "nan": ({"heartbeat_timeout": float("nan")}, {},
                "--heartbeat-timeout must be a number of seconds, more than 0 (not nan or inf), got nan"),
        "hang": ({"hang_timeout": -1.0}, {},
                 "--hang-timeout must be a number of seconds, 0 or more (not nan or inf), got -1"),
        "heartbeats": ({"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0}, {},
                       "--heartbeat-timeout 1 must be larger than --heartbeat-interval 2 (a node silent for the "
                       "timeout is failed): give a timeout of several intervals"),
        "status port": ({"status_port": 70000}, {},
                        "--status-port must be a port from 1 to 65535, or 0 for any free one, got 70000"),
        "job id": ({"rdzv_id": "../x"}, {}, "--rdzv-id '../x': use only letters, digits, '.', '_' and '-' (not '.' "
                                            "or '..' alone): it names the job's folder under --log-dir"),
        "backend": ({"rdzv_backend": "zk"}, {},
                    "--rdzv-backend 'zk': expected c10d or static (the controller is the rendezvous)"),
        "recovery": ({"recovery": "maybe"}, {}, "--recovery must be one of auto, hot-swap, restart, got 'maybe'"),
        "restarts": ({"max_restarts": -1}, {}, "--max-restarts must be 0 or more, got -1"),
        "module and command": ({"module": True, "no_python": True}, {},
                               "-m/--module and --no-python do not go together"),
        "redirects": ({"redirects": "7"}, {}, "bad --redirects '7': expected 0 (none), 1 (stdout), 2 (stderr), "
                                              "3 (both), or per local rank, e.g. 0:3,1:2"),
        "script": ({"script": str(folder / "missing.py")}, {},
                   f"no such script: {folder / 'missing.py'} (give the path of a Python file, -m for a module, or "
                   "--no-python for a command)"),
        "inject": ({"inject": ("explode:1@step=3",)}, {}, "unknown kind 'explode'"),
        "step fault, plain": ({"script": plain, "inject": ("kill-worker:0@step=5",)}, {},
                              "--inject kill-worker:0@step=5: this script does not use dpstate, so dprun does not see "
                              "its steps; trigger it at a time instead (kill-worker:0@t=SECONDS)"),
        "fault node": ({"inject": ("kill-node:1@step=5",)}, {},
                       "--inject kill-node:1@step=5: node rank 1 does not exist with --nnodes 1"),
        "fault worker": ({"inject": ("kill-worker:0.2@step=5",)}, {},
                         "--inject kill-worker:0.2@step=5: local rank 2 does not exist with --nproc-per-node 1"),
        "fault spare": ({"inject": ("kill-spare:0@step=5",)}, {},
                        "--inject kill-spare:0@step=5: spare 0 does not exist with --spares 0"),
        "interval": ({"snapshot_interval": "often"}, {}, "--snapshot-interval must be a positive number of steps, "
                                                         "auto, auto:BUDGET (e.g. auto:0.02 or auto:2%) or off, "
                                                         "got 'often'"),
        "check": ({"snapshot_check": "0"}, {}, "--snapshot-check must be a positive number of blocks (1 in N is "
                                               "checked) or full, got '0'"),
        "replicas": ({"replicas": 0}, {}, "--replicas must be at least 1, got 0"),
        "ring": ({"nnodes": "2", "replicas": 2}, {},
                 "--replicas 2 needs 3 nodes or more: each node's snapshots go to the next --replicas training "
                 "nodes of the ring; use --replicas 1 or a larger --nnodes"),
        "spare exhausted": ({"on_spare_exhausted": "retry"}, {},
                            "--on-spare-exhausted must be 'fail', 'wait' or 'shrink', got 'retry'"),
        "shrink, plain": ({"script": plain, "on_spare_exhausted": "shrink"}, {},
                          "--on-spare-exhausted shrink needs a script that uses dpstate (its processes train a lost "
                          "node's ranks); this one does not: use fail or wait"),
        "shrink, saved": ({"on_spare_exhausted": "shrink", "save_dir": folder / "saved"}, {},
                          "--on-spare-exhausted shrink cannot be used with --save-dir or --resume-from yet: a narrow "
                          "job's snapshots are not written to disk; use wait, or leave out --save-dir"),
        "shrink fallback": ({"on_spare_exhausted": "shrink", "shrink_fallback": "shrink"}, {},
                            "--shrink-fallback must be 'fail' or 'wait', got 'shrink'"),
        "fallback alone": ({"shrink_fallback": "wait"}, {},
                           "--shrink-fallback says what --on-spare-exhausted shrink does where the job cannot shrink: "
                           "give --on-spare-exhausted shrink too, or leave it out"),
        "controller lost": ({"on_controller_lost": "panic"}, {},
                            "--on-controller-lost must be 'cancel' or 'requeue', got 'panic'"),
        "requeue": ({"on_controller_lost": "requeue"}, {}, "--on-controller-lost requeue needs --save-dir: the "
                                                          "requeued job goes on from what is saved there"),
        "save, plain": ({"script": plain, "save_dir": folder / "saved"}, {},
                        "--save-dir needs a script that uses dpstate (its snapshots are what is saved); this one does "
                        "not, so dprun restarts it on a failure (--recovery restart)"),
        "save every": ({"save_every": 5}, {},
                       "--save-every saves into --save-dir: give --save-dir DIR (on storage every node sees)"),
        "save keep": ({"save_dir": folder / "saved", "save_keep": 0}, {},
                      "--save-keep must be 1 or more (the newest complete step is always kept), got 0"),
        "save interval": ({"save_dir": folder / "saved", "save_interval": "soon"}, {},
                          "--save-interval must be a duration above 0 such as 90s, 30m or 2h, got 'soon'"),
        "resume": ({"resume_from": folder / "nothing"}, {},
                   f"--resume-from: {folder / 'nothing'} is not a folder of saved steps (give a --save-dir, or one "
                   "of its step-S folders)"),
        "log dir": ({"log_dir": folder / "a-file" / "logs"}, {}, f"--log-dir {folder / 'a-file' / 'logs'}: "
                                                                 "Not a directory"),
        "events file": ({"events_file": folder / "no" / "e.jsonl"}, {},
                        f"--events-file {folder / 'no' / 'e.jsonl'}: No such file or directory"),
        "token file": ({"token_file": folder / "empty-token"}, {}, f"--token-file {folder / 'empty-token'} is empty"),
        "srun tasks": ({}, {**STEP, "SLURM_STEP_NUM_TASKS": "4"},
                       "the Slurm step runs 4 tasks on 2 node(s), but dprun runs once per node: srun "
                       "--ntasks-per-node=1 dprun ... (its workers come from --nproc-per-node)"),
        "srun nodes": ({"nnodes": "3"}, STEP, "the Slurm step has 2 node(s), fewer than --nnodes 3; ask for more "
                                              "with -N"),
        "endpoint": ({"rdzv_endpoint": "nohostport"}, TOKEN,
                     "bad --rdzv-endpoint 'nohostport': expected HOST:PORT, e.g. 10.0.0.1:29400"),
        "ipv6": ({"rdzv_endpoint": "[::1]:29400"}, TOKEN,
                 "--rdzv-endpoint [::1]: IPv6 addresses are not supported yet: give an IPv4 address or a host name"),
        "rank alone": ({"nnodes": "2", "node_rank": 1}, {},
                       "--node-rank 1 is one node of a multi-node job: give every node --rdzv-endpoint HOST:PORT of "
                       "the node with --node-rank 0 (without it, dprun runs every node on this machine)"),
        "negative rank": ({"node_rank": -5}, {}, "--node-rank must be 0 or more (or left out), got -5"),
        "too many here": ({"nnodes": "200", "spares": 57}, {},
                          "--nnodes 200 + --spares 57 is too many for one machine: at most 256 (give --rdzv-endpoint "
                          "to spread the nodes over machines)"),
        "no token": ({"nnodes": "2", "rdzv_endpoint": "127.0.0.1:29400"}, {},
                     "multi-node mode needs the job's secret: --token-file FILE (the same file on every node) or "
                     "DP_JOB_TOKEN in the environment"),
        "wait alone": ({"on_spare_exhausted": "wait"}, {},
                       "--on-spare-exhausted wait waits for a node to join from another machine, which a standalone "
                       "job cannot take (its nodes are all here): give every node --rdzv-endpoint, or add --spares"),
        "nothing to save": ({"save_dir": folder / "saved", "snapshot_interval": "off"}, {},
                            "--save-dir writes the job's snapshots and --snapshot-interval off takes none: drop one "
                            "of them"),
        "replica dscp": ({}, {"DP_REPLICA_DSCP": "64"}, "DP_REPLICA_DSCP='64': give a DSCP from 0 to 63 "
                         "(1: Lower-Effort, the default; 0: snapshot traffic unmarked)"),
        "gloo lazy connect": ({}, {"DP_GLOO_LAZY_CONNECT": "yes"}, "DP_GLOO_LAZY_CONNECT='yes': give 1 (each pair "
                              "of ranks connects on its first use), 0 (every pair as a group is made) or auto (the "
                              "default: lazily from 128 ranks)"),
        "fetch streams": ({}, {"DP_FETCH_STREAMS": "0"}, "DP_FETCH_STREAMS='0': give how many connections a "
                          "restore's fetch uses, from 1 to 16 (default 1)"),
        "local address": ({"local_addr": "192.0.2.77"}, {}, "--local-addr 192.0.2.77: this machine cannot listen "
                                                            "there ("),  # (TEST-NET-1: on no interface here)
    }


NAMES = list(bad_inputs(Path("/nowhere")))


@pytest.mark.parametrize("name", NAMES)
def test_each_bad_input_is_one_line(name, files):
    given, env, want = bad_inputs(files)[name]
    given.setdefault("script", str(files / "hot.py"))
    with pytest.raises(OptionsError) as caught:
        options_from_args(RunArgs(**given), env, False)
    line = str(caught.value)
    assert "\n" not in line
    if name in ("inject", "local address"):  # (the rest of the line is the parser's, or the OS's)
        assert want in line, line
    else:
        assert line == want
