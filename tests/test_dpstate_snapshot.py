"""Snapshot format and state capture: pack / unpack round trips, bitwise continuation, corruption and unsafe meta."""

from __future__ import annotations

import io
import json
import random
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstate.snapshot import packing as S
from dpstate.snapshot.state import Tracked
from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def make_run(seed: int):
    """A tiny GPT with dropout (so the RNG matters), AdamW, a scheduler and a data sampler."""
    tokens = torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    torch.manual_seed(seed)
    model = train_gpt.GPT(50, 16, n_layer=1, n_embd=32, n_head=2, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = train_gpt.Batches(tokens, 16, 4, seed=seed, rank=0)
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt, scheduler=sched, data=data)
    return model, opt, sched, data, tracked


def train(model, opt, sched, data, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = data.next()
        loss = model(x, y) * (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_round_trip_continues_bitwise_identically():
    model, opt, sched, data, tracked = make_run(seed=7)
    train(model, opt, sched, data, 3)
    meta, buf = S.pack(tracked.capture(3))
    crc = S.checksum(meta, buf)
    expected = train(model, opt, sched, data, 4)  # the original goes on

    fresh = make_run(seed=99)  # different init, different RNG streams
    S.verify(meta, buf, crc)
    tree = S.unpack(meta, buf)
    assert tree["step"] == 3
    fresh[4].restore(tree)
    buf.zero_()  # restored tensors are copies: the buffer can be reused at once
    assert train(*fresh[:4], 4) == expected
    for a, b in zip(params(model), params(fresh[0])):
        assert torch.equal(a, b)
    assert fresh[1].state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh[1].state[fresh[0].head.weight][key], opt.state[model.head.weight][key])
    assert fresh[2].state_dict() == sched.state_dict()


@pytest.mark.parametrize("trained", [False, True], ids=["fresh-optimizer", "optimizer-with-state"])
def test_restore_from_buffer_views_copies_into_place_and_keeps_nothing_of_the_buffer(trained):
    model, opt, sched, data, tracked = make_run(seed=7)
    train(model, opt, sched, data, 3)
    meta, buf = S.pack(tracked.capture(3))
    expected = train(model, opt, sched, data, 4)

    fresh = make_run(seed=99)
    if trained:
        train(*fresh[:4], 2)  # a survivor rolling back: its optimizer state exists
    before = {id(t) for st in fresh[1].state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    weight_ptr = fresh[0].head.weight.data_ptr()
    fresh[4].restore(S.unpack(meta, buf, clone=False))  # views of buf, as a fetched snapshot is restored
    buf.fill_(0x5A)  # the buffer is reused or freed at once: nothing may still point into it
    after = {id(t) for st in fresh[1].state.values() for t in st.values() if isinstance(t, torch.Tensor)}
    assert fresh[0].head.weight.data_ptr() == weight_ptr  # parameters are copied into, not replaced
    assert after == before if trained else len(after) > 0  # an optimizer's own state tensors are reused
    assert train(*fresh[:4], 4) == expected
    for a, b in zip(params(model), params(fresh[0])):
        assert torch.equal(a, b)


def test_capture_references_params_but_clones_what_forward_may_change():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracked = Tracked()
    tracked.add(model=model, optimizer=opt)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    tree = tracked.capture(1)
    sd = tree["state"]["model"]
    assert sd["0.weight"].data_ptr() == model[0].weight.data_ptr()  # no copy on the main thread
    assert sd["1.running_mean"].data_ptr() != model[1].running_mean.data_ptr()  # buffers are cloned
    before = sd["1.running_mean"].clone()
    model(torch.randn(8, 4))  # the next forward updates the running stats
    assert torch.equal(sd["1.running_mean"], before)
    momentum = opt.state[model[0].weight]["momentum_buffer"]
    assert tree["state"]["optimizer"]["state"][0]["momentum_buffer"] is momentum


def test_checksum_detects_any_flipped_byte():
    _, _, _, _, tracked = make_run(seed=1)
    meta, buf = S.pack(tracked.capture(0))
    crc = S.checksum(meta, buf)
    for i in (0, buf.numel() // 2, buf.numel() - 1):
        bad = buf.clone()
        bad[i] ^= 0x40
        with pytest.raises(S.SnapshotError, match="checksum"):
            S.verify(meta, bad, crc)
    bad_meta = bytearray(meta)
    bad_meta[len(meta) // 2] ^= 1
    with pytest.raises(S.SnapshotError, match="checksum"):
        S.verify(bytes(bad_meta), buf, crc)


def test_block_checksum_catches_flips_in_any_block_and_blocks_out_of_place():
    block = S.CHECKSUM_BLOCK
    data = torch.randint(0, 256, (3 * block + 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    crc = S.checksum(b"meta", data)
    assert crc == S.checksum(b"meta", data.numpy().tobytes()) == S.checksum(memoryview(b"meta"), memoryview(data.numpy()))
    for i in (0, 7, block - 1, block + 12345, 3 * block - 8, 3 * block + 999):
        for bit in (0x01, 0x80):
            bad = data.clone()
            bad[i] ^= bit
            assert S.checksum(b"meta", bad) != crc, (i, bit)
    swapped = torch.cat([data[block : 2 * block], data[:block], data[2 * block :]])
    assert S.checksum(b"meta", swapped) != crc, "blocks are placed by the crc32 of their sums"
    assert S.checksum(b"meta", data[:-1]) != crc


def test_truncated_data_and_unsafe_meta_are_refused():
    meta, buf = S.pack({"w": torch.arange(100.0)})
    with pytest.raises(S.SnapshotError, match="does not fit"):
        S.unpack(meta, buf[:200])

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    out = io.BytesIO()
    torch.save({"format": S.FORMAT, "skeleton": Evil(), "tensors": [], "nbytes": 0}, out)
    with pytest.raises(S.SnapshotError, match="refused"):
        S.unpack(out.getvalue(), b"")
    with pytest.raises(S.SnapshotError, match="cannot snapshot"):
        S.pack({"x": object()})


def test_meta_that_is_not_ours_is_refused_not_obeyed():
    meta, buf = S.pack({"w": torch.arange(4.0)})
    doc = json.loads(meta)
    for bad in (b"\x80\x02garbage", b"[1, 2]", json.dumps({**doc, "format": 1}).encode(),
                json.dumps({**doc, "skeleton": {"T": 0}}).encode(),
                json.dumps({**doc, "skeleton": ["T", 5]}).encode(),
                json.dumps({**doc, "tensors": [["float32", [4], 0, 10**9]]}).encode()):
        with pytest.raises(S.SnapshotError):
            S.unpack(bad, buf)
    assert torch.equal(S.unpack(meta, buf)["w"], torch.arange(4.0))


def test_copy_into_never_writes_past_its_buffer():
    tensors = [torch.arange(10, dtype=torch.int64), torch.ones(3)]
    specs, nbytes = S.layout(tensors)
    guard = torch.zeros(nbytes + 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="at least"):
        S.copy_into(tensors, specs, guard[: specs[-1].offset + specs[-1].nbytes - 1])
    tensors[1].resize_(100)  # changed since layout(): its place is too small
    with pytest.raises(S.SnapshotError, match="does not fit"):
        S.copy_into(tensors, specs, guard)
    assert not guard[nbytes:].any()
    S.copy_into([torch.arange(10, dtype=torch.int64), torch.ones(3)], specs, guard)
    assert torch.equal(guard[:80].view(torch.int64), torch.arange(10)) and not guard[nbytes:].any()


def test_copy_into_skips_only_a_tensor_that_is_exactly_its_place():
    """A tensor that an optimizer step wrote into its place (dpstate.snapshot.landing) is not copied; one that merely
    starts there (a transposed view, a shorter one) is, since its bytes are not the place's."""
    tensors = [torch.arange(6.0).view(2, 3), torch.arange(4.0)]
    specs, nbytes = S.layout(tensors)
    buf = torch.zeros(nbytes, dtype=torch.uint8)

    def place(spec: S.TensorSpec) -> torch.Tensor:
        return buf[spec.offset : spec.offset + spec.nbytes].view(torch.float32)

    place(specs[0]).copy_(torch.arange(6.0))
    landed = place(specs[0]).view(2, 3)
    assert S.copy_into([landed, tensors[1]], specs, buf) == specs[0].nbytes
    assert torch.equal(place(specs[1]), torch.arange(4.0))

    transposed = place(specs[0]).view(3, 2).t()  # starts at its place, but is not laid out as the tensor it is
    assert S.copy_into([transposed, tensors[1]], specs, buf) == 0
    assert torch.equal(place(specs[0]), torch.tensor([0.0, 2, 4, 1, 3, 5]))
    with pytest.raises(S.SnapshotError, match="does not fit"):  # starts there, too short: refused, not skipped
        S.copy_into([place(specs[0])[:4], tensors[1]], specs, buf)


def test_rng_states_and_special_values_round_trip():
    tree = {
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "misc": [None, True, 3, 2.5, float("inf"), "s", b"\x00b", (torch.float16, torch.device("cpu"), 1 + 2j)],
        "odd": {"bool": torch.tensor([True, False]), "empty": torch.empty(0, 3), "t": torch.arange(6.0).view(2, 3).t()},
        7: "int key",
    }
    out = S.unpack(*S.pack(tree))
    assert out["rng"]["python"] == tree["rng"]["python"]
    assert out["rng"]["numpy"][0] == "MT19937" and np.array_equal(out["rng"]["numpy"][1], tree["rng"]["numpy"][1])
    assert out["misc"] == tree["misc"] and out[7] == "int key"
    assert torch.equal(out["odd"]["bool"], tree["odd"]["bool"]) and out["odd"]["empty"].shape == (0, 3)
    assert torch.equal(out["odd"]["t"], tree["odd"]["t"])
    sd = torch.nn.Linear(2, 2).state_dict()
    assert S.unpack(*S.pack(sd))._metadata == sd._metadata  # module versions survive


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.text(max_size=8),
    st.binary(max_size=8),
    st.builds(lambda d, n, s: (torch.randn(n, generator=torch.Generator().manual_seed(s)) * 100).to(d),
              st.sampled_from(_DTYPES), st.integers(0, 17), st.integers(0, 1000)),
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids),
                           st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 9)), kids, max_size=4)),
    max_leaves=20,
)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None, database=None)
@given(_trees)
def test_any_state_tree_round_trips(tree):
    meta, buf = S.pack(tree)
    assert _same(S.unpack(meta, buf), tree)
    assert _same(S.unpack(meta, bytes(buf.numpy())), tree)  # from a (read-only) received frame


def test_a_state_that_does_not_fit_the_scripts_objects_is_refused_saying_what_changed():
    """--resume-from a save of another model size, or with other names tracked: the error names the object
    and the likely cause (it read as a node's failure: "size mismatch for 2.weight")."""
    saved = Tracked()
    saved.add(model=torch.nn.Linear(4, 8), optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1))
    tree = saved.capture(7)
    wider = Tracked()
    wider.add(model=torch.nn.Linear(4, 16), optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1))
    with pytest.raises(RuntimeError, match=r"snapshot of step 7 does not fit the script's 'model' \(RuntimeError: "
                                           r"Error\(s\) in loading state_dict.*size mismatch.*model or optimizer "
                                           r"changed"):
        wider.restore(tree)
    renamed = Tracked()
    renamed.add(net=torch.nn.Linear(4, 8))
    with pytest.raises(RuntimeError, match=r"step 7 has no state for \['net'\] \(it holds \['model', 'optimizer'\]\)"
                                           r": the script tracks what was not saved"):
        renamed.restore(tree)
