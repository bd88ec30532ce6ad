"""A script on dpstate under torchrun (env://, no agent) ends with its process groups shut down while the
interpreter still runs, so that no Gloo thread lets go of the last collective during finalization (exit -6);
after an uncaught error they are left as they are."""

import os
import subprocess
import sys

import pytest

from conftest import free_port

SCRIPT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print(f"initialized at exit: {dist.is_initialized()}", flush=True))  # runs after dpstate's
import dpstate
job = dpstate.init()
gathered = [None] * job.world_size
dist.all_gather_object(gathered, {"rank": job.rank})
assert [g["rank"] for g in gathered] == list(range(job.world_size))
if sys.argv[1] == str(job.rank):
    raise RuntimeError("the script's own error")
"""


def _run(procs, tmp_path, raising: int) -> list[tuple[int, str, str]]:
    """Two ranks of SCRIPT under torchrun's environment; rank `raising` raises after the all-gather (-1: none)."""
    script = tmp_path / "gather.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    ranks = [procs.popen([sys.executable, str(script), str(raising)],
                         env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                              "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=90) for p in ranks]
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outputs)]


@pytest.mark.timeout(180)
def test_a_clean_end_under_torchrun_shuts_the_groups_down_before_the_interpreter_finalizes(procs, tmp_path):
    for code, out, err in _run(procs, tmp_path, raising=-1):
        assert code == 0, err[-2000:]
        assert "initialized at exit: False" in out, out + err[-2000:]


@pytest.mark.timeout(180)
def test_after_an_uncaught_error_the_groups_are_left_to_the_exit(procs, tmp_path):
    (code0, out0, err0), (code1, out1, err1) = _run(procs, tmp_path, raising=1)
    assert code0 == 0 and "initialized at exit: False" in out0, out0 + err0[-2000:]
    assert code1 == 1 and "the script's own error" in err1, err1[-2000:]
    assert "initialized at exit: True" in out1, out1 + err1[-2000:]
