"""Runs one job on this machine: the head (controller, TCPStore, local agents) or a joining node's agent.

Standalone mode starts every node here; multi-node mode starts this node's agent and, on the head, the
controller. Returns the job's exit code.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import zmq

from dpcommon import protocol as p
from dpagent.process import LAUNCHER_STOP
from dpagent.shutdown import EXIT_CONTROLLER_LOST, EXIT_NO_CONTROLLER, EXIT_REFUSED, EXIT_USAGE
from dpcommon.save_manifest import newest_saved

from dprun.controller.state_machine import JobSpec, NodeGone
from dprun.controller.vocabulary import OnSpareExhausted, ShrinkFallback
from dprun.monitor.events import EventSink, write_line
from dprun.controller.faults import FaultSpec
from dprun.monitor.jobview import JobView, total_steps_from_args
from .gpus import plan_local_gpus, visible_gpus
from .agent_processes import AgentCommand, LocalAgents, OutputTail
from .controller_shell import ControllerServer, PortInUse
from dprun.slurm import orphaned_job
from dprun.slurm.orphaned_job import OnControllerLost
from dprun.slurm.rendezvous import SlurmJob, controller_lost_notice
from dprun.monitor.status import StatusFeed


@dataclass(frozen=True)
class JobOptions:
    """One job as dprun's command line gave it, checked (dprun.launcher.run_options makes it): what the head, the agents
    and their workers are started with."""

    nnodes: int
    spares: int
    nproc_per_node: int
    script: tuple[str, ...]  # the worker command after the interpreter: SCRIPT ARGS...
    events_file: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    replicas: int = 1
    snapshot_interval: str | None = None  # DP_SNAPSHOT_INTERVAL of the workers (None: theirs, default every step)
    snapshot_check: str | None = None  # DP_SNAPSHOT_CHECK of the workers (None: theirs, default 8)
    hang_timeout: float = 600.0
    on_spare_exhausted: OnSpareExhausted = "fail"
    shrink_fallback: ShrinkFallback = "fail"
    on_controller_lost: OnControllerLost = "cancel"  # under srun: the Slurm job's fate once its batch host died
    slurm: SlurmJob | None = None  # inside an srun step
    spare_wait_timeout: float = 1800.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    probe_timeout: float = 1.0
    rdzv_timeout: float = 300.0
    rdzv_endpoint: str | None = None  # None: standalone
    node_rank: int = -1
    rdzv_id: str | None = None
    token: str | None = None
    local_addr: str | None = None
    no_python: bool = False
    module: bool = False  # -m: SCRIPT is a module
    restart_mode: bool = False  # the script does not use dpstate: recover by restarting every worker
    max_restarts: int = 3
    log_dir: str | None = None
    save_dir: str = ""  # JobSpec's: where a stopping job writes its state, and the saved state to go on from
    resume_from: str = ""
    resume_step: int = -1
    resume_older: tuple[tuple[str, int], ...] = ()  # JobSpec's
    save_every: int = 0
    save_interval: float = 0.0
    save_keep: int = 2
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    tui: bool = False  # the live dashboard owns the terminal
    status_port: int = 0
    total_steps: int | None = None  # for the dashboard's progress bar; default: the script's --steps

    def agent(self, **kw) -> AgentCommand:
        """The command of one local agent with this job's worker settings."""
        return AgentCommand(nproc_per_node=self.nproc_per_node, script=self.script, no_python=self.no_python,
                            module=self.module, log_dir=self.log_dir, redirects=self.redirects, tee=self.tee,
                            local_ranks_filter=self.local_ranks_filter, max_restarts=self.max_restarts,
                            register_timeout=self.rdzv_timeout, terms=self.terms(), **kw)

    def terms(self) -> p.JobTerms:
        """What this dprun was told of the job, for the controller to check (dprun.controller.admission)."""
        return p.JobTerms(nnodes=self.nnodes, rdzv_id=self.rdzv_id or "", script=list(self.script))


def uses_dpstate(script: str, module: bool = False, no_python: bool = False) -> bool:
    """Does the script (a file, a -m module, or a --no-python program) mention dpstate? Read, never imported."""
    path: Path | None = None
    if module:
        parts = script.split(".")
        for base in [os.getcwd(), *sys.path]:
            for candidate in (Path(base, *parts).with_suffix(".py"), Path(base, *parts, "__main__.py")):
                if candidate.is_file():
                    path = candidate
                    break
            if path:
                break
    else:
        found = script if not no_python or os.sep in script else shutil.which(script)
        path = Path(found) if found else None
    try:
        head = path.read_bytes()[:2_000_000] if path is not None else b""
    except OSError:
        return False
    return re.search(rb"\bdpstate\b", head) is not None


def _start_store(host: str):
    """The torch TCPStore that workers build process groups on (imported late: torch is slow to import)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, f"{host}:{store.port}"


# what stops a job in order (its state saved first): torchrun's four; SIGHUP is a closed ssh session or terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _install_signal_handlers(server: ControllerServer) -> None:
    def stop(signum, _frame):
        name = signal.Signals(signum).name
        server.shutdown(128 + signum, f"dprun received {name}; stopping every node")

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def run_head(opts: JobOptions, local_nodes: list[AgentCommand], host: str, port: int, token: str) -> int:
    """Controller + store + the agents of `local_nodes` (+ the dashboard); returns the job's exit code."""
    from dprun.monitor.report import final_summary

    job_id = opts.rdzv_id or f"dp-{secrets.token_hex(4)}"
    sink = EventSink(opts.events_file, console=None if opts.tui else sys.stdout, job_id=job_id)
    launched = sink.emit({"event": "launched", "host": socket.gethostname(), "pid": os.getpid(),  # (the job's t0)
                          "argv": sys.argv[1:]}, console=False)
    view = JobView(job_id=job_id, nproc_per_node=opts.nproc_per_node, started_at=launched["time"],
                   total_steps=opts.total_steps or total_steps_from_args(opts.script[1:]),
                   mode="restart" if opts.restart_mode else "hot-swap", nnodes=opts.nnodes, spares=opts.spares)
    server = ControllerServer(p.Codec(token), host, port, sink, view=view)
    try:
        feed = StatusFeed(host, opts.status_port)
    except OSError as exc:
        server.close()
        raise PortInUse(str(exc)) from None
    server.publish = feed.publish
    view.status_endpoint = feed.endpoint
    feed.register(job_id, [*opts.script])
    capture = _output_file(opts, job_id) if opts.tui else None
    endpoint = server.endpoint
    agents = LocalAgents(
        env={"DP_JOB_TOKEN": token, "DP_TOTAL_LOCAL_WORKERS": str(len(local_nodes) * opts.nproc_per_node),
             **_worker_settings(opts)},
        on_exit=lambda node_id, code, oom: server.post(
            NodeGone(node_id, f"agent process exited ({p.describe_exit(code, oom)})")),
        capture=capture, hosts_controller=True,
    )
    server.wake_node = lambda node_id: agents.signal_node(node_id, signal.SIGCONT)
    try:
        for cmd in local_nodes:
            cmd.controller = endpoint
            agents.start(cmd)
        store, store_endpoint = _start_store(host)
        if opts.restart_mode:
            server.fresh_store = lambda: _start_store(host)
        spec = JobSpec(
            nnodes=opts.nnodes, spares=opts.spares, nproc_per_node=opts.nproc_per_node,
            store_endpoint=store_endpoint, job_id=job_id, heartbeat_interval=opts.heartbeat_interval,
            heartbeat_timeout=opts.heartbeat_timeout, probe_timeout=opts.probe_timeout,
            rdzv_timeout=opts.rdzv_timeout, faults=tuple(opts.faults), replicas=opts.replicas,
            hang_timeout=opts.hang_timeout, on_spare_exhausted=opts.on_spare_exhausted,
            shrink_fallback=opts.shrink_fallback,
            spare_wait_timeout=opts.spare_wait_timeout, restart_mode=opts.restart_mode,
            max_restarts=opts.max_restarts, save_dir=opts.save_dir, resume_from=opts.resume_from,
            resume_step=opts.resume_step, resume_older=opts.resume_older, save_every=opts.save_every,
            save_interval=opts.save_interval, save_keep=opts.save_keep, snapshots=opts.snapshot_interval != "off",
            command=tuple(opts.script),
        )
        _install_signal_handlers(server)
        if not opts.tui:
            mode = "restart (the script does not use dpstate)" if opts.restart_mode else "hot-swap"
            write_line(sys.stdout, f"dprun: job {job_id}, recovery by {mode}; watch it with: dprun status "
                                   f"--endpoint {feed.endpoint}")
        with _dashboard(opts, server, capture):
            finish = server.run(spec)
            agents.wait_all(timeout=10.0)
        del store
        model = server.latest_model or view.model(time.time())
        for line in final_summary(model, finish.exit_code, finish.message):
            print(line, file=sys.stderr if finish.exit_code else sys.stdout)
        if finish.exit_code and opts.save_dir and not finish.saved_in:
            print(_saved_by_nodes(opts.save_dir, opts.nnodes * opts.nproc_per_node), file=sys.stderr)
        if capture is not None:
            print(f"dprun: the workers' and agents' output is in {capture.path}", file=sys.stderr)
        return finish.exit_code
    finally:
        agents.kill_all()
        server.close()
        feed.close()
        sink.close()
        if capture is not None:
            capture.close()


def _saved_by_nodes(save_dir: str, world_size: int) -> str:
    """A failed job's save did not come through the controller (nodes that lost it write on their own): what
    the save dir holds now, to go on from."""
    try:
        folder, step = newest_saved(save_dir, world_size)
    except (ValueError, OSError):
        return f"dprun: {save_dir} holds no step with a file of every rank"
    return f"dprun: {folder} holds every rank's file of step {step}: go on with --resume-from {save_dir}"


def _dashboard(opts: JobOptions, server: ControllerServer, capture: OutputTail | None):
    if not opts.tui:
        return nullcontext()
    from dprun.monitor.dashboard import LiveDashboard

    return LiveDashboard(lambda: server.latest_model, output=capture.latest if capture else None)


def _output_file(opts: JobOptions, job_id: str) -> OutputTail:
    """Where local output goes while the dashboard owns the terminal: <log dir>/<job>/console.log or /tmp."""
    if opts.log_dir:
        folder = Path(opts.log_dir) / job_id
        folder.mkdir(parents=True, exist_ok=True)
        return OutputTail(str(folder / "console.log"))
    fd, path = tempfile.mkstemp(prefix=f"dprun-{job_id}-", suffix=".log")
    os.close(fd)
    return OutputTail(path)


def run_standalone(opts: JobOptions) -> int:
    token = opts.token or secrets.token_hex(16)
    run_dir = tempfile.mkdtemp(prefix="dprun-")
    try:
        nodes = [
            opts.agent(node_id=f"node{i}", controller="", spare=i >= opts.nnodes,
                       node_rank=i if i < opts.nnodes else -1, run_dir=os.path.join(run_dir, f"node{i}"))
            for i in range(opts.nnodes + opts.spares)
        ]
        gpus = plan_local_gpus(len(nodes), opts.nproc_per_node, visible_gpus(), os.environ.get("DP_BACKEND"),
                               active=opts.nnodes)
        if gpus.notice:
            print(gpus.notice, file=sys.stderr, flush=True)
        for node, env in zip(nodes, gpus.per_node):
            node.env.update(env)
            assert node.run_dir is not None  # (each given one above)
            os.makedirs(node.run_dir, exist_ok=True)
        return run_head(opts, nodes, "127.0.0.1", 0, token)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_multinode(opts: JobOptions) -> int:
    host, port = parse_endpoint(opts.rdzv_endpoint or "")
    token = opts.token
    if not token:
        raise SystemExit("dprun: multi-node mode needs the job's secret: --token-file FILE (the same file on "
                         "every node) or DP_JOB_TOKEN in the environment")
    local_addr = opts.local_addr or _route_to(host)
    node_id = f"{socket.gethostname()}-{os.getpid()}"
    run_dir = tempfile.mkdtemp(prefix="dprun-")
    agent = opts.agent(node_id=node_id, controller=f"tcp://{host}:{port}", spare=opts.node_rank >= opts.nnodes,
                       node_rank=opts.node_rank, local_addr=local_addr, run_dir=run_dir)
    try:
        if opts.node_rank == 0 or (opts.node_rank < 0 and is_local(host) and _port_free(host, port)):
            try:
                return run_head(opts, [agent], host, port, token)
            except PortInUse:
                if opts.node_rank == 0:
                    raise
                # another node on this host won the race to host the controller: join it
        return _run_member(agent, token, opts)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _worker_settings(opts: JobOptions) -> dict[str, str]:
    """Environment for workers (through their agents) that follows from the job's options."""
    settings = {"DP_STATUS_INTERVAL": str(opts.heartbeat_interval)}
    if opts.snapshot_interval is not None:  # (not given: the workers' own, else every step)
        settings["DP_SNAPSHOT_INTERVAL"] = opts.snapshot_interval
    if opts.snapshot_check is not None:
        settings["DP_SNAPSHOT_CHECK"] = opts.snapshot_check
    if opts.on_spare_exhausted == "wait" or opts.shrink_fallback == "wait":  # survivors wait as long as it does
        settings["DP_RECONFIGURE_TIMEOUT"] = str(max(120.0, opts.spare_wait_timeout + 60.0))
    return settings


def _run_member(agent: AgentCommand, token: str, opts: JobOptions) -> int:
    """A joining node: its agent does the work; we wait for it and pass on its exit code."""
    agents = LocalAgents(env={"DP_JOB_TOKEN": token, **_worker_settings(opts)}, on_exit=lambda *_: None)
    proc = agents.start(agent)
    signals = []

    def stop(signum, _frame):  # the first is passed on (the agent waits for the controller's save), a second kills
        signals.append(signum)
        if len(signals) == 1 and agents.signal_agent(agent.node_id, LAUNCHER_STOP):
            return
        agents.kill_all()

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    code = proc.wait()
    # (both before kill_all, which ends the watching, and whose signals are ours)
    how = p.describe_exit(code, agents.ended_by_oom_killer(agent.node_id))
    died = code < 0 and not agents.stopping  # of a signal not ours: it could tell no one
    agents.kill_all()
    if code != 0:
        print(f"dprun: this node's agent ended: {how}", file=sys.stderr)
    if died:
        _speak_for_dead_agent(agent, token, how)
    if code == EXIT_USAGE:
        print("dprun: this node did not join the job: the agent's line above says why (a node the controller "
              "refused was started with other settings than the head's: make them the same)", file=sys.stderr)
    if code == EXIT_REFUSED:
        print(f"dprun: the controller at {agent.controller} refused this node: give every node the job's token "
              "(DP_JOB_TOKEN or --token-file) and the same DeadPool version (the agent's line above says which "
              "differs)", file=sys.stderr)
    if code == EXIT_NO_CONTROLLER:
        head = "the step's first node" if opts.slurm else "the node with --node-rank 0"
        print(f"dprun: no controller answered at {agent.controller} within {opts.rdzv_timeout:g} s: check that "
              f"{head} runs dprun with the same endpoint and token (its output says why not) and that this node "
              f"reaches it", file=sys.stderr)
    if code == EXIT_CONTROLLER_LOST and opts.slurm is not None:
        _settle_slurm_job(opts.slurm, opts)
    elif code == EXIT_CONTROLLER_LOST and os.environ.get("SLURM_JOB_ID"):  # a Slurm job, outside an srun step
        print(controller_lost_notice(os.environ["SLURM_JOB_ID"]), file=sys.stderr)
    return code if code >= 0 else 128 - code


def _speak_for_dead_agent(agent: AgentCommand, token: str, how: str) -> None:
    """Tell the controller that this node's agent died, as it could not: the node is failed at once, not at the
    heartbeat timeout. At most 2 s, and best effort: where the controller is gone too, nothing is lost."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)  # how long the message may wait to go out as the socket closes
        sock.connect(agent.controller)
        sock.send_multipart(p.Codec(token).encode(p.AgentExited(agent.node_id, how)))
        sock.close()
    finally:
        ctx.term()


def _settle_slurm_job(job: SlurmJob, opts: JobOptions) -> None:
    """This node saved for the controller's loss: cancel or requeue the Slurm job once it is orphaned (the batch
    script died with the controller's node) and the nodes left have saved (dprun.slurm.orphaned_job); a signal (Slurm
    ending the step, another node's scancel) stops the wait."""
    halted = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: halted.set())
    orphan = orphaned_job.Orphan(job.slurm_id, job.restarts, job.step_nodes, job.step_nodes[job.node_rank],
                                 opts.save_dir)
    line = orphaned_job.settle(orphan, opts.on_controller_lost, halted)
    if line:
        print(line, file=sys.stderr)


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad --rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)




def _route_to(host: str) -> str:
    """The local address this machine uses to reach `host`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def is_local(host: str) -> bool:
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    if addr.startswith("127."):
        return True
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, port))
        return True
    except OSError:
        return False
