"""dpstate.snapshot.warmheap: a spare faults in the heap its first step will use. warm_heap() changes how the C library
manages a whole process, so it runs in a child process here; the e2e test of it is in test_e2e_hotswap.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpstate.snapshot import warmheap

pytestmark = pytest.mark.timeout(60)

CHILD = """
import torch
from dpstate.snapshot.warmheap import heap_rss, warm_heap

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

before = heap_rss()
assert warm_heap(128 << 20)
after, rss_after = heap_rss(), rss()
block = torch.empty(100 << 20, dtype=torch.uint8)  # a later allocation lands in the heap kept, not in new memory
block.fill_(1)
print(before, after, rss() - rss_after)
"""


@pytest.mark.slow  # starts a torch process
def test_warm_heap_faults_in_heap_that_later_allocations_reuse():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, grown = map(int, out.stdout.split())
    # (less the little that the heap had faulted in and free already)
    assert after - before >= 120 << 20, "the heap was not faulted in (or not kept after the free)"
    assert grown < 8 << 20, "a 100 MB tensor allocated after it took new memory"


def test_heap_bytes_is_twice_the_snapshot_unless_configured(monkeypatch):
    monkeypatch.delenv("DP_SPARE_HEAP_BYTES", raising=False)
    monkeypatch.delenv("DP_TOTAL_LOCAL_WORKERS", raising=False)
    assert warmheap.heap_bytes(10 << 20, 1) == 20 << 20
    alone = warmheap.heap_bytes(1 << 50, 1)
    assert alone < 1 << 50  # at most a quarter of what is available
    monkeypatch.setenv("DP_TOTAL_LOCAL_WORKERS", "6")  # a standalone job's 3 nodes of 2 workers on this host
    shared = warmheap.heap_bytes(1 << 50, 2)
    assert 0 < shared < alone and abs(shared * 6 - alone) < alone * 0.2  # ~a sixth (available memory moves)
    monkeypatch.setenv("DP_SPARE_HEAP_BYTES", "0")
    assert warmheap.heap_bytes(10 << 20, 1) == 0
    monkeypatch.setenv("DP_SPARE_HEAP_BYTES", "3e8")
    assert warmheap.heap_bytes(10 << 20, 1) == 300_000_000
