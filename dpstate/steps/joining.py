"""init(): how a worker process joins the job (standalone, under torchrun, or under dprun, where a spare
waits inside it until promoted) and gets its Job.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

import torch.distributed as dist
import zmq

from .abort import AbortSignal
from .agent_link import Control
from .session import Job
from dpcommon import stack_dump
from dpcommon.interpreter_exit import exit_quickly
from dpstate.snapshot.warmheap import warm_while_idle


def _warm_imports() -> None:
    try:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401
    except Exception:
        pass


_job: Job | None = None


def _leave_sigterm_to_the_agent() -> None:
    """Slurm ends a step (its time limit, scancel) by SIGTERM to every process, workers too; the job's save
    (--save-dir) may need them, and their agent stops them once it is done. So a worker notes its first SIGTERM
    and goes on; a second one ends it as before. A handler the script installed before init() is kept."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    if threading.current_thread() is not threading.main_thread():
        return

    def first(_signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("dpstate: SIGTERM: this worker goes on until its agent stops it (after the job's save, if any); a "
              "second SIGTERM ends it now", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, first)


SHUT_DOWN_AFTER_AN_ERROR_S = 5.0


def _shut_groups_down_at_exit() -> None:
    """(atexit, under torchrun) Shut the process groups down while the interpreter still runs: a Gloo worker
    thread lets go of the script's last collective (an all_gather_object's tensors) a moment after the script saw
    it done, and when that falls in the interpreter's finalization the process aborts (-6, "terminate called
    without an active exception"; docs/sequences.md). After an uncaught error an op of this rank may still wait on
    a peer, and the shutdown with it: past SHUT_DOWN_AFTER_AN_ERROR_S the rank exits at once with the error's code."""
    if not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
        return
    shutdown = threading.Thread(target=dist.destroy_process_group, name="dpstate-shutdown", daemon=True)
    shutdown.start()
    shutdown.join(SHUT_DOWN_AFTER_AN_ERROR_S)
    if shutdown.is_alive():
        print(f"dpstate: after the script's error its process groups did not shut down within "
              f"{SHUT_DOWN_AFTER_AN_ERROR_S:g} s (an op still waits on a peer); this rank exits now (code 1)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def init() -> Job:
    """Join the job: connect to the agent, wait (spares: until promoted) for a generation and build its group.
    Without DP_AGENT_ENDPOINT: no snapshots; a single process (world 1), or torchrun's env:// group."""
    global _job
    if _job is not None:
        return _job
    exit_quickly()
    endpoint = os.environ.get("DP_AGENT_ENDPOINT", "")
    if endpoint:  # a dprun worker: its stacks on request, as its agent's are (not in a torchrun user's script)
        stack_dump.install()
    abort = AbortSignal()
    if not endpoint:
        job = Job(None, abort, None)
        job.generation = 0
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_ADDR"):
            # started by torchrun (or another env:// launcher): its process group, no snapshots
            dist.init_process_group(job.backend, init_method="env://", timeout=job._groups.timeout)
            atexit.register(_shut_groups_down_at_exit)
            job._groups.generation = 0
            job.rank, job.world_size = dist.get_rank(), dist.get_world_size()
            job.node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
        else:
            job._groups.build_local()
        _job = job
        return job
    token = os.environ.get("DP_JOB_TOKEN", "")
    if not token:
        raise RuntimeError("dpstate: DP_AGENT_ENDPOINT is set but DP_JOB_TOKEN is not")
    _leave_sigterm_to_the_agent()
    if os.environ.get("DP_ROLE") == "spare":
        # Building DDP or an optimizer imports torch._dynamo (about 2 s here): a spare does it while idle so
        # that it is not on the recovery path (an active worker would only slow its first rendezvous with it).
        threading.Thread(target=_warm_imports, name="dpstate-warm-imports", daemon=True).start()
    ctx = zmq.Context()
    control = Control(endpoint, token, os.environ.get("DP_NODE_ID", "local"),
                      int(os.environ.get("LOCAL_RANK", "0")), abort, ctx)
    control.start()
    atexit.register(control.close)
    job = Job(control, abort, ctx)
    _job = job
    if os.environ.get("DP_ROLE") == "spare" and job.device.type == "cpu":  # activations in host memory
        warm_while_idle(control, job.local_rank, job.local_world_size)
    job._recover(None, newer_than=-1, restore=False)
    return job
