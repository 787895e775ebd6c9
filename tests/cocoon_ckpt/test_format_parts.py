"""The per-part codecs: each returns its part (record and arrays) and writes into
nothing; the snapshot refuses an array two parts encode; every array a snapshot holds
is named by `layout.py` (its kind is one the layout knows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cocoon_ckpt.format.codec import encode
from cocoon_ckpt.format.parts import model, optimizer, rng, user
from cocoon_ckpt.format.snapshot import Encoded, Snapshot
from cocoon_ckpt.layout import SCHEDULER_PREFIX, array_kind, stateful_prefix

from .test_format_golden import STEPS, synthetic_state


def test_two_parts_cannot_encode_one_array() -> None:
    snap = Snapshot(step=1)
    snap.take(Encoded(record=None, arrays={"model/w": np.zeros(2)}))
    with pytest.raises(ValueError, match="array model/w is encoded by two parts"):
        snap.take(Encoded(record={"x": 1}, arrays={"model/w": np.ones(2)}))
    assert np.array_equal(snap.arrays["model/w"], np.zeros(2))


def test_a_part_codec_returns_copies_and_writes_into_nothing() -> None:
    state = synthetic_state(STEPS[-1])
    before = state["model"]["0.weight"].clone()
    first = model.encode(state["model"])
    state["model"]["0.weight"].add_(1.0)  # the trainer steps on: the copy must not move
    assert np.array_equal(first.arrays["model/0.weight"], before.numpy())
    assert first.record is None and set(first.arrays) == {
        "model/0.weight",
        "model/0.bias",
        "model/bn.num_batches_tracked",
    }
    opt = optimizer.encode(state["optimizer"])
    assert opt.record["state"]["0"]["exp_avg"] == {"array": "optim/0/exp_avg"}
    assert opt.record["state"]["1"]["n"] == {"value": STEPS[-1]}
    gen = rng.encode(state["rng"])
    assert torch.equal(torch.from_numpy(gen.arrays["rng/torch"]), state["rng"]["torch"])
    sched = state["scheduler"]
    assert sched is not None
    assert set(user.encode(sched, SCHEDULER_PREFIX).arrays) == {"scheduler/0"}
    ema = user.encode(state["stateful"]["ema"], stateful_prefix("ema"))
    assert set(ema.arrays) == {"stateful/ema/0", "stateful/ema/1"}


def test_every_array_of_a_snapshot_is_of_a_kind_the_layout_names() -> None:
    snap = encode(synthetic_state(STEPS[-1]), None)
    kinds = {array_kind(name) for name in (*snap.arrays, *snap.references)}
    assert kinds == {"model", "optimizer", "rng", "ring", "scheduler", "stateful"}
    assert snap.shard is not None
    assert snap.shard["slots"] == snap.records["noise"]["shards"][0]["slots"]


def test_an_unencodable_user_part_is_named() -> None:
    part = {"kind": "job.Bad", "state": {"f": object()}}
    with pytest.raises(TypeError, match=r"job\.Bad\.state_dict\(\)"):
        user.encode(part, stateful_prefix("bad"))
