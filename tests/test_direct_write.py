"""A file written past the page cache holds exactly its bytes, whatever their sizes against the alignment and the
staging buffer; a filesystem that refuses O_DIRECT gets the same file through the page cache
(dpcommon.direct_write, real files)."""

from __future__ import annotations

import errno
import os

import pytest

from dpcommon import direct_write
from dpcommon.direct_write import ALIGN, STAGE_BYTES, write_synced

pytestmark = pytest.mark.timeout(60)

SIZES = [[0], [1], [ALIGN - 1], [ALIGN], [ALIGN + 1], [17, ALIGN * 3 + 5, 0, 900],
         [STAGE_BYTES - 3, 7], [STAGE_BYTES], [STAGE_BYTES + ALIGN + 1, 2 * STAGE_BYTES - 1]]


def _pieces(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


@pytest.mark.parametrize("sizes", SIZES, ids=lambda sizes: "+".join(map(str, sizes)))
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_the_file_holds_exactly_its_pieces(tmp_path, sizes, direct):
    pieces = _pieces(sizes)
    path = tmp_path / "f.bin"
    write_synced(path, [memoryview(p) for p in pieces], direct=direct)
    assert path.read_bytes() == b"".join(pieces)


def test_a_filesystem_that_refuses_o_direct_gets_the_file_through_the_page_cache(tmp_path, monkeypatch):
    refused: list[str] = []

    def refuse(path):
        refused.append(str(path))
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_write, "_open_direct", refuse)
    pieces = _pieces([ALIGN * 2 + 3, 11])
    write_synced(tmp_path / "f.bin", [memoryview(p) for p in pieces])
    assert refused == [str(tmp_path / "f.bin")] and (tmp_path / "f.bin").read_bytes() == b"".join(pieces)


def test_a_write_the_disk_refuses_is_raised_not_retried(tmp_path, monkeypatch):
    def full(fd, block):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(direct_write, "_write_all", full)
    with pytest.raises(OSError) as raised:
        write_synced(tmp_path / "f.bin", [memoryview(b"x" * 10)])
    assert raised.value.errno == errno.ENOSPC


def test_dp_save_direct_0_writes_through_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DP_SAVE_DIRECT", "0")
    monkeypatch.setattr(direct_write, "_open_direct", lambda path: pytest.fail("O_DIRECT with DP_SAVE_DIRECT=0"))
    write_synced(tmp_path / "f.bin", [memoryview(b"abc")])
    assert (tmp_path / "f.bin").read_bytes() == b"abc"
