"""Ring slots as rows: one (k, width) array per version, slots referenced by (array,
row); older one-array-per-slot stores still resume and audit; retention never removes
an array a kept version's rows need; the audit names the damaged slot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt import ResumeAllowances, export_model, run_job
from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.format.ring_rows import borrowable, encode_slots, load_ring, slot_refs
from cocoon_ckpt.layout import ring_name, ring_rows_name
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.audit.arrays import check_checksums
from cocoon_ckpt.tools.audit.report import AuditReport
from cocoon_ckpt.tools.bounds import VersionBounds
from cocoon_ckpt.train.options import JobOptions
from state import Manifest, Store, Version, restamp
from state.arrays import write_array, written_meta

from .conftest import job_config

KEY = bytes(range(32))
WIDTH = 37


class _CountingRing(HostRing):
    """A host ring that counts row reads and refuses a whole-ring gather."""

    reads = 0

    def read(self, slot: int, out: np.ndarray | None = None) -> np.ndarray:
        self.reads += 1
        return super().read(slot, out)

    def gather(self) -> np.ndarray:
        raise AssertionError("a snapshot must not gather the whole ring")


def _noise(bands: int, history: HostRing | None = None) -> BandMFNoise:
    return BandMFNoise(BandMF.banded_sqrt(bands, 64), WIDTH, KEY, 1.0, history=history)


def _commit(store: Store, noise: BandMFNoise, parent: Manifest | None) -> Manifest:
    """One version holding the noise ring as the codec writes it."""
    state = noise.state_dict()
    arrays: dict[str, np.ndarray] = {}
    refs: dict[str, Any] = {}
    prev = parent.records["noise"]["shards"][0]["slots"] if parent is not None else None
    entries = encode_slots(
        state["ring"],
        state["slot_steps"],
        lambda a, b: ring_rows_name(0, a, b),
        parent,
        borrowable(parent, prev),
        arrays,
        refs,
    )
    txn = store.begin(noise.t, parent=parent.version if parent is not None else None)
    for name, arr in arrays.items():
        txn.put_array(name, arr)
    for name, meta in refs.items():
        txn.reference(name, meta)
    txn.put_record(
        "noise", {"t": noise.t, "shards": [{"start": 0, "stop": WIDTH, "slots": entries}]}
    )
    return txn.commit()


def _ring_of(version: Version, bands: int) -> np.ndarray:
    like = _noise(bands).state_dict()
    got = load_ring(like, version.records["noise"]["shards"], version)
    out: np.ndarray = got["ring"].gather()
    return out


def test_snapshot_reads_only_the_new_rows() -> None:
    ring = _CountingRing(7, WIDTH, "float32")
    noise = _noise(8, ring)
    for _ in range(10):
        noise.step()
    state = noise.state_dict()
    assert state["ring"] is ring  # by reference: nothing gathered
    arrays: dict[str, np.ndarray] = {}
    entries = encode_slots(
        ring, state["slot_steps"], lambda a, b: f"r/w-{a}-{b}", None, {}, arrays, {}
    )
    assert ring.reads == 7 and list(arrays) == ["r/w-3-9"] and arrays["r/w-3-9"].shape == (7, WIDTH)
    for slot, step, name, row, crc in entries:
        assert np.array_equal(arrays[name][row], ring.read(slot)) and step == 3 + row
        assert crc.startswith("crc32c:")


def test_one_array_per_version_and_rows_read_back(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    noise = _noise(8)
    parent = None
    for t in range(1, 21):
        noise.step()
        if t % 3 == 0:
            parent = _commit(store, noise, parent)
            own = [
                n
                for n, a in parent.arrays.items()
                if a.path.startswith(f"versions/{parent.version:08d}-")
            ]
            assert own == [ring_rows_name(0, t - 3, t - 1)]
            assert parent.arrays[own[0]].shape == (3, WIDTH)
            ver = Version(store, parent)
            assert np.array_equal(_ring_of(ver, 8), noise.history.gather())


@settings(max_examples=25, deadline=None)
@given(
    bands=st.integers(2, 9),
    cadence=st.lists(st.integers(1, 9), min_size=2, max_size=8),
    keep=st.integers(2, 4),
)
def test_retention_never_removes_a_referenced_rows_array(
    tmp_path_factory: pytest.TempPathFactory, bands: int, cadence: list[int], keep: int
) -> None:
    store = Store.open(str(tmp_path_factory.mktemp("ret") / "s.zarr"))
    store.acquire_lease()
    noise = _noise(bands)
    parent = None
    for k in cadence:
        for _ in range(k):
            noise.step()
        parent = _commit(store, noise, parent)
        store.retain(keep_last=keep, newest_valid=parent.version)
        for v in store.versions():
            m = store.manifest(v)
            refs = slot_refs(m.records["noise"]["shards"][0]["slots"])
            assert {r.array for r in refs} <= set(m.arrays)  # every row's array is named
            ver = Version(store, m)
            ver.verify()  # ... and still stored whole
            assert len(refs) == min(m.step, bands - 1)
        assert np.array_equal(_ring_of(Version(store, parent), bands), noise.history.gather())


def test_audit_names_the_damaged_slot(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    noise = _noise(6)
    for _ in range(5):
        noise.step()
    m = _commit(store, noise, None)
    name = ring_rows_name(0, 0, 4)
    chunk = tmp_path / "s.zarr" / m.arrays[name].path / "c.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[2 * WIDTH * 4 + 5] ^= 0xFF  # inside row 2: the slot of step 2
    chunk.write_bytes(bytes(raw))
    report = AuditReport(store=str(tmp_path / "s.zarr"))
    check_checksums(store, {m.version: m}, {m.version: VersionBounds()}, report)
    found = [f.message for f in report.findings if f.check == "checksums"]
    assert any("slot of step 2 (row 2 of" in f for f in found), found
    assert not any("slot of step 1 " in f or "slot of step 3 " in f for f in found)


def _to_one_array_per_slot(root: Path) -> None:
    """Rewrite a store as the writer before rows did: every slot its own 1-D array
    `ring/shard-0000/w-<step>` in the version that first held it, borrowed by path."""
    store = Store.open(str(root), create=False)
    per_slot: dict[int, dict[str, Any]] = {}
    for v in store.versions():
        path = root / "manifests" / f"{v:08d}.json"
        doc = json.loads(path.read_text())
        shard = doc["records"]["noise"]["shards"][0]
        entries = []
        for slot, step, name, row, _crc in shard["slots"]:
            meta = doc["arrays"][name]
            if step not in per_slot:
                folder = meta["path"].split("/ring/")[0]
                ver = Version(store, store.manifest(v))
                values = np.ascontiguousarray(ver.array(name)[row])
                old = ring_name(0, step)
                checksum, chunks = write_array(store.backend, folder, old, values)
                per_slot[step] = written_meta(f"{folder}/{old}", values, checksum, chunks).to_json()
            entries.append([slot, step, ring_name(0, step)])
        for name in [n for n in doc["arrays"] if n.startswith("ring/")]:
            del doc["arrays"][name]
        for _slot, step, old in entries:
            doc["arrays"][old] = per_slot[step]
        shard["slots"] = entries
        path.write_bytes(restamp(doc))
    for block in root.glob("versions/*/ring/shard-0000/w-*-*"):
        shutil.rmtree(block)  # no rows array left: the old form must stand alone


def test_old_one_array_per_slot_store_resumes_and_audits(tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=4, steps=16, keep_last=3)
    key = str(tmp_path / "k")
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    export_model(str(tmp_path / "gold.zarr"), str(tmp_path / "gold.pt"))
    url = tmp_path / "old.zarr"
    run_job(cfg, str(url), stop_after=11, options=JobOptions(key_file=key))
    _to_one_array_per_slot(url)
    old = Store.open(str(url), create=False).latest()
    assert old is not None and all(len(e) == 3 for e in old.records["noise"]["shards"][0]["slots"])
    report = audit_store(str(url), key_file=key, coordinates=16, seed=0)
    # an old store carries no MACs: each version is an authentication finding, and the
    # only finding
    assert {f.check for f in report.findings} == {"authentication"}, report.text()
    allow = ResumeAllowances(unauthenticated=True)
    run_job(
        cfg, str(url), options=JobOptions(key_file=key, allow=allow)
    )  # borrows the old slots, writes rows
    export_model(str(url), str(tmp_path / "got.pt"))
    gold, got = torch.load(tmp_path / "gold.pt"), torch.load(tmp_path / "got.pt")
    assert all(torch.equal(gold[k], got[k]) for k in gold)
    new = Store.open(str(url), create=False).latest()
    assert new is not None
    assert 5 in {len(e) for e in new.records["noise"]["shards"][0]["slots"]}
