"""A precompute that survives a crash: each finished tile is kept in the store (its
arrays checksummed, a done-marker), a stopped precompute resumes from them and computes
only the rest, and the CSC is the same bits as an uninterrupted one. A tile that fails
its checksum or belongs to another precompute is computed again, never trusted; a
writer that was taken over stops; the parts go once a version holds the CSC."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cocoon_ckpt import BandMF
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.embedding import AccessSchedule, CoalescedCSC, precompute_csc, table_noise
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.embedding.precompute import AFTER_TILE, TileLayout
from cocoon_ckpt.embedding.stored_tiles import PRECOMPUTE, TILE_KEPT, StoredTiles, TileWriter
from cocoon_ckpt.examples.dlrm import zipf_ids
from cocoon_ckpt.layout import emb_name
from fault_injection import CrashPointHit, crash_at, disarm_all, known_points
from fault_injection.chaos import draw_schedule
from state import FencedError, Store
from state.arrays import write_array

from .conftest import job_config

KEY = bytes(range(32))
ROWS, STEPS, DIM, TILE = 600, 12, 4, 50  # 12 tiles of 50 slots (hot = 0)

TILE_KEY = bytes(range(32))  # a tile MAC key, as keys.tile_mac_key derives one


def _case() -> tuple[AccessSchedule, BandMF, np.ndarray]:
    rng = np.random.default_rng(3)
    sched = AccessSchedule.from_step_rows(
        ROWS, [zipf_ids(ROWS, 20, 1.2, rng) for _ in range(STEPS)]
    )
    return sched, BandMF.banded_sqrt(4, STEPS), np.linspace(0.01, 0.3, STEPS)


def _csc(parts: StoredTiles | None = None, threads: int = 1) -> CoalescedCSC:
    sched, mech, f = _case()
    noise = table_noise(KEY, "emb.weight", ROWS, DIM, 0.7, torch.float32)
    return precompute_csc(
        sched, sched.noise_order(), 0, DIM, mech, noise, f,
        tile_rows=TILE, threads=threads, parts=parts,
    )  # fmt: skip


def _same(a: CoalescedCSC, b: CoalescedCSC) -> None:
    for name, x in a.arrays().items():
        y = b.arrays()[name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


def _store(path: Path) -> Store:
    store = Store.open(str(path))
    store.acquire_lease()
    return store


def _markers(root: Path) -> list[Path]:
    return sorted((root / "shared" / PRECOMPUTE).rglob("*.done"))


def test_precompute_crash_points_are_known_and_drawn_where_they_fire() -> None:
    assert {AFTER_TILE, TILE_KEPT} <= set(known_points())
    rng = random.Random(0)
    dense = draw_schedule(job_config("dlrm"), 200, rng)
    assert not {AFTER_TILE, TILE_KEPT} & {p for p, _ in dense}  # no precompute: never fire
    emb = EmbeddingConfig(mode="coalesced", threat_model="final_model", hot_threshold=2)
    coalesced = draw_schedule(job_config("dlrm", embedding=emb), 200, rng)
    # at the precompute's first tile: a step could name a tile count it never reaches
    assert {s for p, s in coalesced if p in (AFTER_TILE, TILE_KEPT)} == {None}


@pytest.mark.parametrize("threads", [1, 2])
def test_stopped_precompute_resumes_from_its_tiles_bit_identical(
    tmp_path: Path, threads: int
) -> None:
    whole = _csc()
    store = _store(tmp_path / "s.zarr")
    crash_at(AFTER_TILE, step=5)
    try:
        with pytest.raises(CrashPointHit):
            _csc(StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY), threads)
    finally:
        disarm_all()
    kept = len(_markers(tmp_path / "s.zarr"))
    assert kept == 5  # the crash came right after the 5th tile was durable
    again = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    _same(_csc(again, threads), whole)
    assert (again.loaded, again.computed) == (5, 12 - 5)
    # a third run finds every tile and computes none
    third = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    _same(_csc(third), whole)
    assert (third.loaded, third.computed) == (12, 0)


def test_tiles_kept_on_a_writer_thread_resume_bit_identical(tmp_path: Path) -> None:
    whole = _csc()
    store = _store(tmp_path / "s.zarr")
    crash_at(TILE_KEPT, step=4)  # raised on the writer's thread, re-raised here
    try:
        with pytest.raises(CrashPointHit), TileWriter() as writer:
            _csc(StoredTiles(store, "emb.weight", "d" * 32, writer, mac_key=TILE_KEY), threads=2)
    finally:
        disarm_all()
    assert len(_markers(tmp_path / "s.zarr")) == 4  # the writer stopped at its failure
    with TileWriter() as writer:
        again = StoredTiles(store, "emb.weight", "d" * 32, writer, mac_key=TILE_KEY)
        resumed = _csc(again, threads=2)
    _same(resumed, whole)
    assert (again.loaded, again.computed) == (4, 12 - 4)


def test_damaged_or_foreign_tiles_are_computed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole = _csc()
    root = tmp_path / "s.zarr"
    store = _store(root)
    _csc(StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY))
    folder = root / "shared" / PRECOMPUTE / "emb.weight" / ("d" * 32)
    # tile 2: a flipped bit in a chunk of its values
    chunk = next(p for p in (folder / "tile-000002" / "values").rglob("c*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    # tile 4: a marker that fails its sha256
    marker = folder / "tile-000004.done"
    marker.write_bytes(marker.read_bytes().replace(b'"entries": ', b'"entries": 1'))
    # tile 7: tile 6's whole marker under tile 7's name (right digest, wrong tile)
    (folder / "tile-000007.done").write_bytes((folder / "tile-000006.done").read_bytes())
    caplog.set_level(logging.WARNING, "cocoon_ckpt.embedding.stored_tiles")
    again = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    _same(_csc(again), whole)
    assert (again.loaded, again.computed) == (9, 3)
    untrusted = sorted(
        int(m.group(1)) for m in re.finditer(r"precompute tile (\d+) .* not trusted", caplog.text)
    )
    assert untrusted == [2, 4, 7]
    # another digest (another key, config or plan) finds nothing of this one's
    other = StoredTiles(store, "emb.weight", "e" * 32, mac_key=TILE_KEY)
    _same(_csc(other), whole)
    assert (other.loaded, other.computed) == (0, 12)


def test_a_writer_taken_over_stops_before_its_next_tile(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    store = _store(root)
    parts = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    newer = Store.open(str(root), create=False)
    crash_at(AFTER_TILE, step=3)
    try:
        with pytest.raises(CrashPointHit):
            _csc(parts)
    finally:
        disarm_all()
    newer.acquire_lease(takeover=True)
    with pytest.raises(FencedError):
        _csc(parts)
    # on the writer's thread: its first tile is refused, and so is the precompute
    with pytest.raises(FencedError), TileWriter() as writer:
        _csc(StoredTiles(store, "emb.weight", "d" * 32, writer, mac_key=TILE_KEY), threads=2)
    assert len(_markers(root)) == 3  # nothing written after the takeover


# -- a real `cocoon-ckpt train`, SIGKILLed inside its precompute ---------------------

_TILES = re.compile(r"table (\S+): precompute tiles loaded from the store: (\d+), computed: (\d+)")


def _train(store: Path, key: Path) -> list[str]:
    return [
        *("--log-level", "INFO", "train", "--example", "dlrm"),
        *("--embedding", "coalesced", "--threat-model", "final_model", "--hot-threshold", "2"),
        # a 200,000-row table: tiles of 32,768 rows at dim 8, b = 8
        *("--job-option", "tables=[200000,300]", "--store", str(store), "--key-file", str(key)),
        *("--steps", "16", "--checkpoint-every", "8", "--bands", "8", "--batch-size", "16"),
        *("--dataset-size", "256", "--quiet"),
    ]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )


def _tiles(log: str) -> dict[str, tuple[int, int]]:
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _TILES.finditer(log)}


def _csc_bytes(store: Path) -> dict[str, bytes]:
    version = Store.open(str(store), create=False).latest()
    assert version is not None
    return {
        f"{p}/{k}": version.array(emb_name(p, f"csc/{k}")).tobytes()
        for p in ("tables.0.weight", "tables.1.weight")
        for k in ("col_ptr", "rows", "values")
    }


def _export(store: Path, key: Path, out: Path) -> dict[str, torch.Tensor]:
    assert main(["export", str(store), "--key-file", str(key), "--out", str(out)]) == 0
    return torch.load(out)  # type: ignore[no-any-return]


def test_sigkill_in_the_precompute_resumes_bit_identical(tmp_path: Path) -> None:
    key = tmp_path / "noise.key"
    gold, run = tmp_path / "gold.zarr", tmp_path / "run.zarr"
    first = _run(_train(gold, key))
    assert first.returncode == 0, first.stderr
    whole = _tiles(first.stderr)
    assert set(whole) == {"tables.0.weight", "tables.1.weight"}
    assert all(loaded == 0 for loaded, _ in whole.values()) and whole["tables.0.weight"][1] > 3

    # killed on the tile writer's thread right after the 3rd tile is durable
    killed = _run(_train(run, key), {"COCOON_CRASH_AT": "precompute.tile_kept:step=3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (run / "manifests").exists() or not list((run / "manifests").iterdir())
    kept = len(_markers(run))
    assert kept == 3
    # gc (retention) on a store whose precompute is in progress deletes none of it
    gc = _run(["gc", str(run), "--keep", "2"])
    assert gc.returncode == 0, gc.stderr
    assert len(_markers(run)) == kept

    resumed = _run(_train(run, key))
    assert resumed.returncode == 0, resumed.stderr
    tiles = _tiles(resumed.stderr)
    # only the unfinished tiles were computed again
    assert sum(t[0] for t in tiles.values()) == kept
    assert {p: sum(t) for p, t in tiles.items()} == {p: t[1] for p, t in whole.items()}
    assert not (run / "shared" / PRECOMPUTE).exists()  # a version holds the CSC now

    assert _csc_bytes(run) == _csc_bytes(gold)
    want = _export(gold, key, tmp_path / "gold.pt")
    got = _export(run, key, tmp_path / "run.pt")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    audit = _run(["audit", "--key-file", str(key), "--example", "dlrm", "--seed", "1", str(run)])
    assert audit.returncode == 0, audit.stdout + audit.stderr

    # killed right after its first version committed, before it deleted the parts: the
    # next start finds the CSC in that version and deletes them then
    late = tmp_path / "late.zarr"
    killed = _run(_train(late, key), {"COCOON_CRASH_AT": "checkpoint.after_manifest:step=8"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _markers(late) and Store.open(str(late), create=False).versions() == [1]
    resumed = _run(_train(late, key))
    assert resumed.returncode == 0, resumed.stderr
    assert not _tiles(resumed.stderr)  # no precompute: the CSC came from version 1
    assert not (late / "shared" / PRECOMPUTE).exists()
    got = _export(late, key, tmp_path / "late.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_tile_forged_without_the_key_is_computed_again(tmp_path: Path) -> None:
    """A writer of the store without the job's key rewrites a kept tile's values and
    re-stamps its crc32c and the marker's sha256: the tile's MACs fail, it is computed
    again, and the CSC is the uninterrupted one."""
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    slots = np.arange(4)
    parts = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    values = np.random.default_rng(0).standard_normal((3, 2))
    parts.save(0, slots, (np.arange(3), np.arange(3), values))
    backend = store.backend
    tile = f"precompute/emb.weight/{'d' * 32}/tile-000000"
    backend.rm(f"shared/{tile}/values", recursive=True)
    checksum, _ = write_array(backend, "shared", f"{tile}/values", np.zeros((3, 2)))
    marker = f"shared/{tile}.done"
    rec = json.loads(backend.read_bytes(marker))
    rec.pop("sha256")
    rec["arrays"]["values"]["checksum"] = checksum
    text = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
    rec["sha256"] = hashlib.sha256(text).hexdigest()
    backend.rm(marker)
    backend.create_once(marker, json.dumps(rec, sort_keys=True).encode())
    again = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY)
    assert again.load(0, slots, TileLayout(3, 2, np.dtype(np.float64))) is None
    assert not backend.exists(marker)  # discarded, to be computed again
    # the same tile under the key it was kept with loads as it was written
    parts.save(1, slots, (np.arange(3), np.arange(3), values))
    got = StoredTiles(store, "emb.weight", "d" * 32, mac_key=TILE_KEY).load(
        1, slots, TileLayout(3, 2, np.dtype(np.float64))
    )
    assert got is not None and np.array_equal(got[2], values)
    other = StoredTiles(store, "emb.weight", "d" * 32, mac_key=bytes(32))
    assert other.load(1, slots, TileLayout(3, 2, np.dtype(np.float64))) is None
