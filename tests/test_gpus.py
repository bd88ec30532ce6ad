"""dprun.launcher.gpus: which GPUs each local node sees when several nodes share one host (NCCL wants one GPU per
rank), and the worker side's refusal to treat NCCL's "Duplicate GPU detected" as a peer failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpstate.steps.abort import classify
from dpstate.groups.pgroup import GpuPlacementError
from dprun.launcher.gpus import plan_local_gpus

pytestmark = pytest.mark.timeout(10)


def test_enough_gpus_each_local_node_gets_a_disjoint_slice():
    plan = plan_local_gpus(3, 2, ["0", "1", "2", "3", "4", "5", "6", "7"], None)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan.per_node] == ["0,1", "2,3", "4,5"]
    assert plan.notice == ""


def test_slices_follow_the_names_in_cuda_visible_devices():
    plan = plan_local_gpus(2, 1, ["GPU-a", "GPU-b", "GPU-c"], None)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan.per_node] == ["GPU-a", "GPU-b"]


def test_too_few_gpus_hides_cuda_from_every_local_node_and_says_so():
    plan = plan_local_gpus(3, 1, ["0"], None)  # the README demo (2 nodes + 1 spare) on a one-GPU host
    assert plan.per_node == [{"CUDA_VISIBLE_DEVICES": ""}] * 3
    assert "need 3 GPUs" in plan.notice and "1 are visible" in plan.notice and "fewer nodes or spares" in plan.notice


@pytest.mark.parametrize("nodes, visible, backend", [
    (1, ["0"], None),  # one node sees every GPU, as under torchrun
    (3, [], None),  # no GPU: nothing to share
    (3, ["0"], "nccl"),  # the user chose the backend
    (3, ["0"], "gloo"),
])
def test_left_alone(nodes, visible, backend):
    plan = plan_local_gpus(nodes, 1, visible, backend)
    assert plan.per_node == [{}] * nodes and plan.notice == ""


def test_one_training_node_and_its_spares_all_see_every_gpu():
    """A spare never trains beside the one node it replaces (NCCL only sees the ranks of one group), so a
    one-GPU host runs `--nnodes 1 --spares 1` on its GPU (tests/test_cuda_gpu.py runs exactly that)."""
    plan = plan_local_gpus(2, 1, ["0"], None, active=1)
    assert plan.per_node == [{}, {}] and plan.notice == ""
    assert plan_local_gpus(3, 1, ["0"], None, active=2).per_node == [{"CUDA_VISIBLE_DEVICES": ""}] * 3


def test_nccl_duplicate_gpu_is_not_taken_for_a_peer_failure():
    error = GpuPlacementError("NCCL refuses two ranks on one GPU ... or set DP_BACKEND=gloo")
    assert classify(error) is None  # propagates: the worker ends with the message, no recovery loop


def test_hidden_cuda_is_known_without_importing_torch():
    """CUDA_VISIBLE_DEVICES empty: no GPU, said without torch's import (seconds on the path to every job's
    start, where CI and these tests run)."""
    code = ("import sys; from dprun.launcher.gpus import visible_gpus; "
            "assert visible_gpus() == [] and 'torch' not in sys.modules, sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": " "},
                          capture_output=True, text=True, timeout=8)
    assert proc.returncode == 0, proc.stderr[-2000:]
