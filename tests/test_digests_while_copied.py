"""The snapshot checksum computed while the snapshot is still being copied (dpcommon.checksum.BlockDigester):
any order of progress, any thread count, with or without a check plan, gives the one-pass checksum exactly,
and a capture that uses it stays restorable."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dpcommon.checksum import CHECKSUM_BLOCK, BlockDigester, CheckPlan, checksum_and_digests, digest_threads
from dpstate.snapshot import packing as S

pytestmark = pytest.mark.timeout(60)
META = b'{"format": "test"}'


@pytest.mark.parametrize("threads", [0, 1, 3])
@pytest.mark.parametrize("plan", [None, CheckPlan(shared_blocks=40, shared_key=7, every=4, phase=3)])
def test_digests_made_range_by_range_equal_the_one_pass_checksum(threads, plan):
    rng = random.Random(threads)
    data = np.frombuffer(rng.randbytes(70 * CHECKSUM_BLOCK + 4321), dtype=np.uint8)
    expected = checksum_and_digests(META, data, plan)
    digester = BlockDigester(data, plan, threads)
    upto = 0
    while upto < data.size:  # progress in uneven steps, some within one block, some across many
        upto = min(data.size, upto + rng.choice([17, CHECKSUM_BLOCK - 1, 5 * CHECKSUM_BLOCK, 23 * CHECKSUM_BLOCK]))
        digester.ready(upto)
    crc, digests = digester.checksum(META)
    assert crc == expected[0] and np.array_equal(digests, expected[1])


def test_a_buffer_smaller_than_a_block_has_only_its_tail_checksummed():
    data = np.arange(1000, dtype=np.uint8)
    assert BlockDigester(data, None, 2).checksum(META)[0] == checksum_and_digests(META, data, None)[0]


def test_copy_into_says_each_final_prefix_in_order_and_the_capture_checksums_as_before():
    """The data parallel tensors (shared) lie first in the buffer, whatever their place in the tree: a prefix
    is said final only once every tensor below its end is copied."""
    tensors = [torch.randn(300_000), torch.arange(5, dtype=torch.int64), torch.randn(2_000_000)]
    specs, nbytes, _ = S.layout_shared(tensors, [False, False, True])
    assert specs[2].offset == 0 < specs[0].offset
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    digester = BlockDigester(buffer.numpy(), None, 2)
    seen = []
    S.copy_into(tensors, specs, buffer, on_copied=lambda end: (seen.append(end), digester.ready(end)))
    assert seen == sorted(seen) and seen[-1] == max(s.offset + s.nbytes for s in specs)
    assert digester.checksum(META)[0] == checksum_and_digests(META, buffer.numpy(), None)[0]


def test_the_thread_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DP_CHECKSUM_THREADS", "0")
    assert digest_threads() == 0
    monkeypatch.delenv("DP_CHECKSUM_THREADS")
    assert 1 <= digest_threads() <= 4
