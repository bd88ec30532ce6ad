"""Command line of the node agent: `python -m dpagent [options] -- SCRIPT [ARGS...]` (started by dprun).

The job token comes from the environment (DP_JOB_TOKEN), never from the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys

from .agent import Agent, AgentConfig, AgentError
from dpcommon import stack_dump
from dpcommon.interpreter_exit import exit_quickly
from dpcommon.memory import reuse_freed_memory
from .output import OutputSpec, parse_ranks, parse_std
from .process import LAUNCHER_GONE, set_pdeathsig
from dpcommon.protocol import NO_RANK, JobTerms, checked
from .shutdown import EXIT_USAGE
from .workers import worker_command



def _job_terms(text: str) -> JobTerms:
    """--job-terms as the launcher writes it: {"nnodes": N, "rdzv_id": ID, "script": [ARG, ...]}."""
    try:
        return checked(JobTerms, json.loads(text))
    except ValueError as exc:  # (bad JSON, or a ProtocolError)
        raise argparse.ArgumentTypeError(f"not a JSON object of nnodes, rdzv_id and script: {exc}") from None

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpagent",
        description="DeadPool node agent: registers with the controller, runs and supervises this node's "
        "workers, relays control messages and holds peers' snapshot replicas. Needs DP_JOB_TOKEN.",
        usage="%(prog)s --controller tcp://HOST:PORT [options] -- SCRIPT [ARGS...]",
    )
    p.add_argument("--controller", required=True, help="controller endpoint, tcp://HOST:PORT")
    p.add_argument("--node-id", default=f"{socket.gethostname()}-{os.getpid()}", help="unique node name")
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node (default 1)")
    p.add_argument("--spare", action="store_true", help="ask to be a spare node (a hint)")
    p.add_argument("--node-rank", type=int, default=NO_RANK, help="preferred node rank (a hint; default -1)")
    p.add_argument("--local-addr", default="127.0.0.1", help="address the replica store binds (default 127.0.0.1)")
    p.add_argument("--run-dir", help="directory for the ipc socket (default: a temp dir removed on exit)")
    p.add_argument("--log-dir", help="write each worker's stdout and stderr to "
                   "LOG_DIR/<job>/<node>/attempt_<k>/<local_rank>/{stdout,stderr}.log")
    p.add_argument("-r", "--redirects", default="0", help="torchrun's: streams to the log files only "
                   "(0 none, 1 stdout, 2 stderr, 3 both; or per local rank: 0:3,1:2)")
    p.add_argument("-t", "--tee", default="0", help="torchrun's: streams to the log files and the console")
    p.add_argument("--local-ranks-filter", default="", help="only these local ranks reach the console (e.g. 0,1)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("--max-restarts", type=int, default=3, help="restart mode: TORCHELASTIC_MAX_RESTARTS")
    p.add_argument("--stop-grace", type=float, default=3.0, help="seconds workers get after Stop (default 3)")
    p.add_argument("--term-grace", type=float, default=2.0, help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--register-timeout", type=float, default=300.0, help="exit 4 without a Welcome by then")
    p.add_argument("--python", default=sys.executable, help="interpreter for SCRIPT (default: this one)")
    p.add_argument("--no-python", action="store_true", help="run SCRIPT directly, not through python")
    p.add_argument("--job-terms", type=_job_terms, default=JobTerms(), help="JSON: what the launcher was told of "
                   "the job (nnodes, rdzv_id, script), for the controller to check")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _setup_logging(node_id: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[dpagent {node_id}] %(message)s"))
    logger = logging.getLogger("dpagent")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    exit_quickly()
    stack_dump.install()
    pdeathsig = os.environ.get("DP_PDEATHSIG")
    launcher = pdeathsig if pdeathsig in ("controller", "member") else ""
    if launcher:  # its death: the controller's (a save), or this node leaves the job
        set_pdeathsig(LAUNCHER_GONE)
    elif pdeathsig == "1":
        set_pdeathsig()  # die with the launcher
    opts_argv, command = _split(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    opts = parser.parse_args(opts_argv)
    if not command:
        parser.error("no worker script: put it after --, e.g. -- train.py --lr 0.1")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", opts.node_id):
        parser.error(f"--node-id {opts.node_id!r}: use letters, digits, '_', '.', '-' (at most 64)")
    if opts.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    try:
        parse_std(opts.redirects, "--redirects")
        parse_std(opts.tee, "--tee")
        ranks = parse_ranks(opts.local_ranks_filter)
    except ValueError as exc:
        parser.error(str(exc))
    output = OutputSpec(log_dir=opts.log_dir, redirects=opts.redirects, tee=opts.tee,
                        local_ranks_filter=frozenset(ranks) if ranks is not None else None)
    token = os.environ.get("DP_JOB_TOKEN", "")
    if not token:
        print("dpagent: error: DP_JOB_TOKEN is not set; the launcher passes the job's secret token in it",
              file=sys.stderr)
        return EXIT_USAGE
    _setup_logging(opts.node_id, opts.verbose)
    reuse_freed_memory()  # before any snapshot is received (see dpcommon/memory.py)
    cfg = AgentConfig(
        controller=opts.controller,
        node_id=opts.node_id,
        token=token,
        command=worker_command(command[0], command[1:], None if opts.no_python else opts.python, opts.module),
        nproc=opts.nproc_per_node,
        spare=opts.spare,
        node_rank=opts.node_rank,
        local_addr=opts.local_addr,
        run_dir=opts.run_dir,
        stop_grace=opts.stop_grace,
        term_grace=opts.term_grace,
        register_timeout=opts.register_timeout,
        launcher=launcher,
        output=output,
        max_restarts=opts.max_restarts,
        terms=opts.job_terms,
    )
    try:
        code = Agent(cfg).run()
    except AgentError as exc:
        logging.getLogger("dpagent").error("%s", exc)
        code = EXIT_USAGE
    logging.getLogger("dpagent").info("exit %d", code)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code % 256)  # helper threads may still sit in wait(); the context is already closed
