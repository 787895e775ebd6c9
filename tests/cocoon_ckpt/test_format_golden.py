"""The version format keeps its bytes: a store written by the codec before it was split
into per-part codecs (`golden/format_store`, from `write_golden` at that commit) still
decodes to the state that wrote it, and encoding that state today gives the same arrays
(bit for bit, same names), the same references and the same records (same sha256)."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.format.codec import decode, encode
from cocoon_ckpt.format.trainer_state import TRAINER_SCHEMA, TrainerState
from state import Manifest, Store, Version

GOLDEN = Path(__file__).parent / "golden" / "format_store"
WIDTH, SLOTS = 11, 3
#: The steps of the golden versions: the second borrows ring rows of the first.
STEPS = (2, 3)


def _rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def synthetic_state(step: int) -> TrainerState:
    """A trainer state holding every part the codec writes (no embedding tables), each
    value a pure function of `step`: ring rows of steps 0..step-1, optimizer tensors and
    plain values, every generator, a scheduler and two stateful parts with tuples,
    non-finite floats and tensors."""
    g = _rng(7)
    rows = g.standard_normal((step, WIDTH)).astype(np.float32)
    ring = np.zeros((SLOTS, WIDTH), np.float32)
    slot_steps: list[int | None] = [None] * SLOTS
    for t in range(max(0, step - SLOTS), step):
        ring[t % SLOTS], slot_steps[t % SLOTS] = rows[t], t
    gen = _rng(100 + step)
    model = {
        "0.weight": torch.from_numpy(gen.standard_normal((4, 3)).astype(np.float32)),
        "0.bias": torch.from_numpy(gen.standard_normal(4).astype(np.float32)),
        "bn.num_batches_tracked": torch.tensor(step, dtype=torch.int64),
    }
    exp_avg = torch.from_numpy(gen.standard_normal((4, 3)).astype(np.float32))
    optimizer = {
        "param_groups": [{"lr": 0.1, "betas": [0.9, 0.999], "params": [0, 1]}],
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": exp_avg}, 1: {"n": step}},
    }
    np_state = np.random.RandomState(step).get_state(legacy=True)
    py_rng = __import__("random").Random(step).getstate()
    generator = torch.Generator().manual_seed(step)
    layout_placement: list[Any] = [{"tier": "host", "start": 0, "stop": WIDTH}]
    return {
        "kind": "DPTrainer",
        "schema_version": TRAINER_SCHEMA,
        "step": step,
        "model": model,
        "optimizer": optimizer,
        "noise": {
            "kind": "BandMFNoise",
            "schema_version": 1,
            "start": 0,
            "stop": WIDTH,
            "t": step,
            "dtype": "float32",
            "ring": HostRing.holding(ring),
            "slot_steps": slot_steps,
            "persistent_rows": True,
        },
        "noise_layout": {
            "dim": WIDTH,
            "param_names": ["0.weight", "0.bias"],
            "rank": None,
            "placement": layout_placement,
            "plan": None,
            "history_bytes": ring.nbytes,
        },
        "sampler": {"kind": "CyclicPoissonSampler", "seed": 3, "t": step},
        "accountant": {"kind": "Accountant", "epsilon": None, "steps": step},
        "mechanism": {"kind": "BandMF", "bands": SLOTS + 1, "coef": [1.0, 0.5, 0.25, 0.125]},
        "generator": {"backend": "numpy-sfc64-blake2b256-block65536/v2"},
        "rng": {
            "torch": generator.get_state(),
            "numpy": tuple(np_state),
            "python": py_rng,
        },
        "embedding": None,
        "embedding_tables": None,
        "identity": None,
        "scheduler": {
            "kind": "torch.optim.lr_scheduler.StepLR",
            "state": {
                "last_epoch": step,
                "base_lrs": [0.1],
                "_last_lr": [0.1 * 0.5**step],
                "warm": torch.full((2,), 0.5**step, dtype=torch.float64),
            },
        },
        "stateful": {
            "ema": {
                "kind": "job.Ema",
                "state": {
                    "shadow": torch.arange(5, dtype=torch.float64) * step,
                    "pair": (1, "two", None),
                    "bad": -math.inf,
                    "nested": {"k": [torch.ones(2, dtype=torch.int32), math.nan]},
                },
            },
            "counter": {"kind": "job.Counter", "state": {"n": step, 3: "int key"}},
        },
    }


def write_golden(root: Path) -> None:
    """The golden store: one version per step of `STEPS`, each encoded from
    `synthetic_state` against its parent, as the checkpointer writes them."""
    store = Store.open(str(root))
    store.acquire_lease()
    parent: Manifest | None = None
    for step in STEPS:
        snap = encode(synthetic_state(step), parent)
        txn = store.begin(step, parent=parent.version if parent is not None else None)
        for name, arr in snap.arrays.items():
            txn.put_array(name, arr)
        for name, meta in snap.references.items():
            txn.reference(name, meta)
        for name, rec in snap.records.items():
            txn.put_record(name, rec)
        parent = txn.commit()
    store.release_lease()


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A copy of the golden store (opening a store may write to it: a lease, caches)."""
    root = tmp_path_factory.mktemp("golden") / "s.zarr"
    shutil.copytree(GOLDEN, root)
    return Store.open(str(root), create=False)


def _equal(a: Any, b: Any) -> bool:
    """Deep equality with tensors and arrays compared bit for bit (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, HostRing):
        return isinstance(b, HostRing) and np.array_equal(a.gather(), b.gather())
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b) and type(a) is type(b)


def _version(store: Store, step: int) -> Version:
    """The golden version of `step` (versions are numbered 1, 2, ... in step order)."""
    return store.read(store.versions()[STEPS.index(step)])


def test_the_golden_store_has_every_part(golden: Store) -> None:
    assert [golden.read(v).step for v in golden.versions()] == list(STEPS)
    latest = golden.latest()
    assert latest is not None
    names = set(latest.array_names())
    for prefix in ("model/", "optim/", "rng/", "ring/", "scheduler/", "stateful/ema/"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert {"scheduler", "stateful", "optimizer", "rng", "noise"} <= set(latest.records)


@pytest.mark.parametrize("step", STEPS)
def test_a_golden_version_decodes_to_the_state_that_wrote_it(golden: Store, step: int) -> None:
    version = _version(golden, step)
    want = synthetic_state(step)
    got = decode(version, synthetic_state(0))
    # where the history lies is the receiving job's: decode keeps `like`'s layout
    got["noise_layout"] = want["noise_layout"]
    # the ring comes back as a plain host ring of the receiving shard's shape
    assert _equal(got["noise"]["ring"], want["noise"]["ring"])
    got["noise"]["ring"] = want["noise"]["ring"]
    for part in want:
        assert _equal(got[part], want[part]), part


@pytest.mark.parametrize("step", STEPS)
def test_encoding_today_gives_the_golden_bytes(golden: Store, step: int) -> None:
    version = _version(golden, step)
    manifest = version.manifest
    parent = golden.manifest(manifest.parent) if manifest.parent is not None else None
    snap = encode(synthetic_state(step), parent)
    assert set(snap.arrays) | set(snap.references) == set(version.array_names())
    for name, arr in snap.arrays.items():
        stored = version.array(name)
        assert arr.dtype == stored.dtype and arr.shape == stored.shape, name
        assert arr.tobytes() == stored.tobytes(), name
    for name, meta in snap.references.items():
        assert meta == manifest.arrays[name], name
    # the new arrays lie in this version's folder, the references in the parent's
    folders = {manifest.arrays[n].path.split("/")[1] for n in snap.arrays}
    assert len(folders) == 1 and folders.isdisjoint(
        manifest.arrays[n].path.split("/")[1] for n in snap.references
    )
    assert snap.records == {k: version.records[k] for k in snap.records}
    assert set(snap.records) == set(version.records)


if __name__ == "__main__":  # regenerate: python tests/cocoon_ckpt/test_format_golden.py DIR
    write_golden(Path(sys.argv[1]))
