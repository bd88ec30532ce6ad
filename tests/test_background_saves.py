"""Background saves without processes: the manifests and what makes a step complete (dpcommon.save_manifest),
the schedule (dprun.controller.background_saves) and the controller's part (asking the stores, restoring from disk)."""

from __future__ import annotations

import os

import pytest

from dpcommon import protocol as p
from dpcommon.checksum import checksum_chunks
from dpcommon.save_manifest import complete_steps, prune, read_step, resume_steps, verify_step, write_manifest
from dpcommon.snapshot_files import step_folder, write_snapshot
from dprun.controller.background_saves import BackgroundSaves
from dprun.controller.state_machine import NodeGone
from helpers.controller_harness import formed, spec

META = b'{"step": 1}'


def _save_step(save_dir, step: int, world: int, writers: int = 1, skip: tuple = ()) -> None:
    """Rank files of `step` for `world` ranks, named by `writers` manifest parts (ranks split between them)."""
    folder = step_folder(save_dir, step)
    written: dict[int, list[int]] = {}
    for rank in range(world):
        if rank in skip:
            continue
        data = os.urandom(1000 + rank)
        write_snapshot(folder, rank, step, checksum_chunks(META, [data]), META, [data])
        written.setdefault(rank % writers, []).append(rank)
    for writer, ranks in written.items():
        write_manifest(folder, step, world, ranks, f"node{writer}")


def test_a_step_is_complete_once_its_manifest_parts_name_every_rank_at_its_size(tmp_path):
    _save_step(tmp_path, 10, 4, writers=2)
    saved = read_step(step_folder(tmp_path, 10))
    assert saved.complete and saved.world_size == 4 and sorted(saved.ranks) == [0, 1, 2, 3]
    assert not verify_step(saved)
    _save_step(tmp_path, 20, 4, writers=2, skip=(3,))  # a writer killed before its last file
    assert "name no file of rank 3" in read_step(step_folder(tmp_path, 20)).problems[0]
    (step_folder(tmp_path, 10) / "manifest.node1.json").unlink()  # the second writer never finished
    assert "name no file of ranks 1, 3" in read_step(step_folder(tmp_path, 10)).problems[0]


def test_a_truncated_or_flipped_file_is_found_cheaply_or_by_verify(tmp_path):
    _save_step(tmp_path, 10, 2)
    victim = step_folder(tmp_path, 10) / "rank-1.dpsnap"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 1
    victim.write_bytes(bytes(data))
    saved = read_step(step_folder(tmp_path, 10))
    assert saved.complete, "a flipped byte keeps the size: only reading every byte finds it"
    assert "rank-1.dpsnap is corrupt" in verify_step(saved)[0]
    victim.write_bytes(bytes(data[:100]))
    assert "rank-1.dpsnap is 100 bytes, its manifest says" in read_step(step_folder(tmp_path, 10)).problems[0]


def test_a_writer_that_writes_twice_into_one_step_keeps_naming_its_first_files(tmp_path):
    _save_step(tmp_path, 10, 2, skip=(1,))
    data = os.urandom(10)
    write_snapshot(step_folder(tmp_path, 10), 1, 10, checksum_chunks(META, [data]), META, [data])
    write_manifest(step_folder(tmp_path, 10), 10, 2, [1], "node0")
    assert read_step(step_folder(tmp_path, 10)).complete


def test_resume_takes_the_newest_complete_step_and_lists_the_older_ones_to_fall_back_to(tmp_path):
    for step in (10, 20, 30):
        _save_step(tmp_path, step, 2)
    _save_step(tmp_path, 40, 2, skip=(0,))
    usable, skipped = resume_steps(tmp_path, 2)
    assert [s.step for s in usable] == [30, 20, 10] and [s.step for s in skipped] == [40]
    assert [s.step for s in resume_steps(step_folder(tmp_path, 20), 2)[0]] == [20], "a step folder as is"
    with pytest.raises(ValueError, match="holds a job of 2 ranks and this one has 3"):
        resume_steps(step_folder(tmp_path, 20), 3)
    with pytest.raises(ValueError, match="no step-S folder .* complete save of a job of 3 ranks"):
        resume_steps(tmp_path, 3)
    with pytest.raises(ValueError, match="cannot resume from .*step-40: .*name no file of rank 0"):
        resume_steps(step_folder(tmp_path, 40), 2)
    with pytest.raises(ValueError, match="is not a folder of saved steps"):
        resume_steps(tmp_path / "nowhere", 2)


def test_prune_keeps_the_newest_complete_steps_and_any_save_newer_than_them(tmp_path):
    for step in (5, 10, 15, 20):
        _save_step(tmp_path, step, 2)
    _save_step(tmp_path, 12, 2, skip=(1,))  # cut short, older than the newest complete: goes
    _save_step(tmp_path, 25, 2, skip=(1,))  # being written now: stays
    removed = prune(tmp_path, keep=2)
    assert sorted(f.name for f in removed) == ["step-10", "step-12", "step-5"]
    assert [s.step for s in complete_steps(tmp_path, 2)[0]] == [20, 15]
    assert step_folder(tmp_path, 25).exists()
    assert prune(tmp_path / "empty", keep=1) == []


def test_the_schedule_saves_every_n_steps_or_after_the_interval_and_skips_while_one_is_written():
    saves = BackgroundSaves(every=10, interval_s=0, now=0.0)
    assert not saves.due(9, 1.0) and saves.due(10, 1.0)
    saves.sizes = {0: 5_000_000, 1: 5_000_000}
    work = saves.begin(10, "/d/step-10", {0: "a", 1: "b"}, now=1.0)
    assert work.nbytes == 10_000_000 and not saves.due(19, 2.0)
    note = saves.skip(20, now=11.0)
    assert "still being written after 10.0 s (under 1 MB/s): step 20 is skipped" in note
    assert saves.skip(30, now=12.0) is None, "said once"
    assert saves.answered("a", 10, {"0": ""}, 13.0) is None
    outcome = saves.answered("b", 10, {"1": ""}, 13.0)
    assert outcome.ok and saves.safe == ("/d/step-10", 10) and "step 10 in /d/step-10" in saves.safe_note()
    timed = BackgroundSaves(every=0, interval_s=60, now=0.0)
    assert not timed.due(5, 59.0) and timed.due(5, 60.0)
    assert not BackgroundSaves(0, 0, 0.0).enabled and BackgroundSaves(0, 0, 0.0).safe_note() == ""


def test_a_save_whose_writer_is_lost_or_refused_fails_and_each_kind_is_said_once():
    saves = BackgroundSaves(every=5, interval_s=0, now=0.0)
    saves.begin(5, "/d/step-5", {0: "a", 1: "b"}, now=0.0)
    outcome = saves.node_lost("b", 1.0)
    assert not outcome.ok and "b, which was writing ranks [1], was lost" in outcome.why and saves.safe is None
    saves.begin(10, "/d/step-10", {0: "a", 1: "b"}, now=2.0)
    saves.answered("b", 10, {"1": "cannot write rank 1's file: [Errno 28] No space left on device"}, 3.0)
    first = saves.answered("a", 10, {"0": "cannot write rank 0's file: [Errno 28] No space left on device"}, 3.0)
    assert saves.first_time(first.why)
    again = f"a: cannot write rank 0's file: [Errno 28] No space left on device; {first.why}"
    assert not saves.first_time(again), "the same failure, said by another node first"


def _with_copies(h, step: int, holders: dict[int, str]) -> None:
    """Every rank made `step` (Progress from its node) and its copy of it is stored on its holder."""
    for rank, holder in holders.items():
        h.msg(h.c.timeline.node_of_rank(rank), p.Progress(h.c.timeline.node_of_rank(rank), 0, rank, step))
    for rank, holder in holders.items():
        h.msg(holder, p.SnapshotStored(holder, rank, step, 0, 1000))


def test_the_controller_asks_each_rank_of_one_holder_and_publishes_the_save_once_all_answered():
    h = formed(spec(save_dir="/d", save_every=5))
    _with_copies(h, 5, {0: "b", 1: "a"})
    (to_a,) = h.sent_to("a", p.SaveSnapshots)
    (to_b,) = h.sent_to("b", p.SaveSnapshots)
    assert (to_a.ranks, to_b.ranks) == ([1], [0]) and to_a.background and to_a.keep == 2 and to_a.world_size == 2
    assert to_a.directory == "/d/step-5"
    h.msg("a", p.SnapshotFiles("a", 5, {"1": ""}))
    h.msg("b", p.SnapshotFiles("b", 5, {"0": ""}))
    (saved,) = h.named("state_saved")
    assert saved["step"] == 5 and saved["bytes"] == 2000
    _with_copies(h, 6, {0: "b", 1: "a"})
    assert len(h.sent_to("a", p.SaveSnapshots)) == 1, "not due again before step 10"


def test_a_rank_lost_in_memory_with_a_step_on_disk_sends_every_rank_back_to_it():
    h = formed(spec(nnodes=3, spares=2, save_dir="/d", save_every=5))
    h.register("c", rank=2)
    h.register("t", spare=True)
    _with_copies(h, 5, {0: "b", 1: "c", 2: "a"})
    for node, rank in (("a", 2), ("b", 0), ("c", 1)):
        h.msg(node, p.SnapshotFiles(node, 5, {str(rank): ""}))
    _with_copies(h, 7, {0: "b", 1: "c", 2: "a"})
    h.feed(NodeGone("b", "killed"))
    h.feed(NodeGone("c", "killed"))
    h.pong_all()
    h.pong_all()  # (state looks lost: probed once more)
    (restoring,) = h.named("restoring_from_disk")
    assert restoring["ranks"] == [1] and restoring["step"] == 5 and restoring["folder"] == "/d/step-5"
    loads = {node: h.sent_to(node, p.LoadSnapshots) for node in ("a", "s", "t")}
    assert all(len(sent) == 1 and sent[0].step == 5 and sent[0].generation == 1 for sent in loads.values())
    assert not h.sent_to("a", p.Reconfigure)[1:], "no generation starts before the files are read"
    for node, ranks in (("a", [0]), ("s", [1]), ("t", [2])):
        h.msg(node, p.SnapshotFiles(node, 5, {str(rank): "" for rank in ranks}))
    reconfigure = h.sent_to("a", p.Reconfigure)[-1]
    assert reconfigure.generation == 1 and reconfigure.restore_step == 5 and reconfigure.restore_from == {
        "0": "tcp://a:1"}
