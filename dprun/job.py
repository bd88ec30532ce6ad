"""Runs one job on this machine: the head (controller, TCPStore, local agents) or a joining node's agent.

Standalone mode starts every node here; multi-node mode starts this node's agent and, on the head, the
controller. Returns the job's exit code.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import tempfile
import shutil
from dataclasses import dataclass, field

from dpagent import protocol as p

from .controller import JobSpec, NodeGone
from .events import EventSink
from .faults import FaultSpec
from .launch import AgentCommand, LocalAgents
from .server import ControllerServer, PortInUse


@dataclass
class JobOptions:
    nnodes: int
    spares: int
    nproc_per_node: int
    script: list[str]  # the worker command after the interpreter: SCRIPT ARGS...
    events_file: str | None = None
    faults: list[FaultSpec] = field(default_factory=list)
    replicas: int = 1
    hang_timeout: float = 600.0
    on_spare_exhausted: str = "fail"
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


def _start_store(host: str):
    """The torch TCPStore that workers build process groups on (imported late: torch is slow to import)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, f"{host}:{store.port}"


def _install_signal_handlers(server: ControllerServer) -> None:
    def stop(signum, _frame):
        name = signal.Signals(signum).name
        server.shutdown(128 + signum, f"dprun received {name}; stopping every node")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def run_head(opts: JobOptions, local_nodes: list[AgentCommand], host: str, port: int, token: str) -> int:
    """Controller + store + the agents of `local_nodes`; returns the job's exit code."""
    sink = EventSink(opts.events_file)
    server = ControllerServer(p.Codec(token), host, port, sink)
    job_id = opts.rdzv_id or f"dp-{secrets.token_hex(4)}"
    endpoint = server.endpoint
    agents = LocalAgents(
        env={"DP_JOB_TOKEN": token, "DP_TOTAL_LOCAL_WORKERS": str(len(local_nodes) * opts.nproc_per_node)},
        on_exit=lambda node_id, code: server.post(NodeGone(node_id, f"agent process exited ({_exit_words(code)})")),
    )
    server.wake_node = lambda node_id: agents.signal_node(node_id, signal.SIGCONT)
    try:
        for cmd in local_nodes:
            cmd.controller = endpoint
            agents.start(cmd)
        store, store_endpoint = _start_store(host)
        spec = JobSpec(
            nnodes=opts.nnodes, spares=opts.spares, nproc_per_node=opts.nproc_per_node,
            store_endpoint=store_endpoint, job_id=job_id, heartbeat_interval=opts.heartbeat_interval,
            heartbeat_timeout=opts.heartbeat_timeout, probe_timeout=opts.probe_timeout,
            rdzv_timeout=opts.rdzv_timeout, faults=tuple(opts.faults), replicas=opts.replicas,
            hang_timeout=opts.hang_timeout, on_spare_exhausted=opts.on_spare_exhausted,
            spare_wait_timeout=opts.spare_wait_timeout,
        )
        _install_signal_handlers(server)
        finish = server.run(spec)
        agents.wait_all(timeout=10.0)
        del store
        if finish.exit_code != 0:
            print(f"dprun: job failed: {finish.message}", file=sys.stderr)
        return finish.exit_code
    finally:
        agents.kill_all()
        server.close()
        sink.close()


def run_standalone(opts: JobOptions) -> int:
    token = opts.token or secrets.token_hex(16)
    run_dir = tempfile.mkdtemp(prefix="dprun-")
    try:
        nodes = [
            AgentCommand(node_id=f"node{i}", controller="", nproc_per_node=opts.nproc_per_node, script=opts.script,
                         spare=i >= opts.nnodes, node_rank=i if i < opts.nnodes else -1,
                         run_dir=os.path.join(run_dir, f"node{i}"), no_python=opts.no_python)
            for i in range(opts.nnodes + opts.spares)
        ]
        for node in nodes:
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
    agent = AgentCommand(node_id=node_id, controller=f"tcp://{host}:{port}", nproc_per_node=opts.nproc_per_node,
                         script=opts.script, spare=opts.node_rank >= opts.nnodes, node_rank=opts.node_rank,
                         local_addr=local_addr, run_dir=run_dir, no_python=opts.no_python)
    try:
        if opts.node_rank == 0 or (opts.node_rank < 0 and _is_local(host) and _port_free(host, port)):
            try:
                return run_head(opts, [agent], host, port, token)
            except PortInUse:
                if opts.node_rank == 0:
                    raise
                # another node on this host won the race to host the controller: join it
        return _run_member(agent, token)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_member(agent: AgentCommand, token: str) -> int:
    """A joining node: its agent does the work; we wait for it and pass on its exit code."""
    agents = LocalAgents(env={"DP_JOB_TOKEN": token}, on_exit=lambda *_: None)
    proc = agents.start(agent)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _f: agents.kill_all())
    code = proc.wait()
    agents.kill_all()
    if code != 0:
        print(f"dprun: this node's agent ended: {_exit_words(code)}", file=sys.stderr)
    return code if code >= 0 else 128 - code


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad --rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def _exit_words(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _route_to(host: str) -> str:
    """The local address this machine uses to reach `host`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _is_local(host: str) -> bool:
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
