"""A script on dpstate under torchrun (env://, no agent) ends with its process groups shut down while the
interpreter still runs, so that no Gloo thread lets go of the last collective during finalization (exit -6);
after an uncaught error too, and where an op still waits on a peer the rank exits with the error's code soon."""

import os
import subprocess
import sys

import pytest

from conftest import free_port

SCRIPT = """
import atexit, os, sys, time
import torch
import torch.distributed as dist
atexit.register(lambda: print(f"initialized at exit: {dist.is_initialized()}", flush=True))  # runs after dpstate's
import dpstate
job = dpstate.init()
gathered = [None] * job.world_size
dist.all_gather_object(gathered, {"rank": job.rank})
assert [g["rank"] for g in gathered] == list(range(job.world_size))
if sys.argv[1] == str(job.rank):
    if sys.argv[2] != "-":
        dist.all_reduce(torch.ones(1), async_op=True)  # which its peer never joins
    raise RuntimeError("the script's own error")
if sys.argv[2] != "-":
    while not os.path.exists(sys.argv[2]):  # alive, and out of the collective, until the test says
        time.sleep(0.05)
"""


def _start(procs, tmp_path, raising: int, pending: str = "-") -> list[subprocess.Popen]:
    """Two ranks of SCRIPT under torchrun's environment; rank `raising` raises after the all-gather (-1: none),
    with an all-reduce left waiting on its peer where `pending` names the file whose creation ends that peer."""
    script = tmp_path / "gather.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    return [procs.popen([sys.executable, str(script), str(raising), pending],
                         env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                              "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]


def _run(procs, tmp_path, raising: int) -> list[tuple[int, str, str]]:
    ranks = _start(procs, tmp_path, raising)
    outputs = [p.communicate(timeout=90) for p in ranks]
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outputs)]


@pytest.mark.timeout(180)
def test_a_clean_end_under_torchrun_shuts_the_groups_down_before_the_interpreter_finalizes(procs, tmp_path):
    for code, out, err in _run(procs, tmp_path, raising=-1):
        assert code == 0, err[-2000:]
        assert "initialized at exit: False" in out, out + err[-2000:]


@pytest.mark.timeout(180)
def test_after_an_uncaught_error_the_groups_are_shut_down_too(procs, tmp_path):
    (code0, out0, err0), (code1, out1, err1) = _run(procs, tmp_path, raising=1)
    assert code0 == 0 and "initialized at exit: False" in out0, out0 + err0[-2000:]
    assert code1 == 1 and "the script's own error" in err1, err1[-2000:]
    assert "initialized at exit: False" in out1, out1 + err1[-2000:]


@pytest.mark.timeout(180)
def test_a_rank_that_raised_with_an_op_waiting_on_a_live_peer_exits_with_the_error_s_code(procs, tmp_path):
    peer, raising = _start(procs, tmp_path, raising=1, pending=str(tmp_path / "peer may end"))
    out1, err1 = raising.communicate(timeout=90)  # its peer still runs
    assert raising.returncode == 1 and "the script's own error" in err1, err1[-2000:]
    assert "its process groups did not shut down within 5 s (an op still waits on a peer)" in err1, err1[-2000:]
    assert peer.poll() is None
    (tmp_path / "peer may end").touch()
    out0, err0 = peer.communicate(timeout=90)
    assert peer.returncode == 0 and "initialized at exit: False" in out0, out0 + err0[-2000:]
