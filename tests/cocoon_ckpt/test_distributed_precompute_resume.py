"""A coalesced precompute on several ranks survives a crash: each rank keeps its own
finished tiles in a folder of its own (`shared/precompute/<param>/<digest>/g<gen>-r<rank>`,
no lease needed, fenced by rank 0's lease generation), and a job SIGKILLed during its
precompute on 2 real gloo ranks resumes on 2 ranks, or on 1 process, computing only the
tiles none of its ranks kept; the CSC is the bits of an uninterrupted precompute.

Each process runs the real `train` command in a child interpreter with precompute
tiles of TILE_ROWS rows, so every table's cold slots split into several tiles and each
rank computes many."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt.embedding.csc_shards import whole_csc
from cocoon_ckpt.embedding.stored_tiles import PRECOMPUTE, StoredTiles
from cocoon_ckpt.format.stored import records_of
from state import FencedError, Store, Version
from tests.cocoon_ckpt.rank_jobs import free_port, rank_env

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TILE_ROWS = 32
KILL_AT = 4  # each rank is killed right after its 4th tile is durable

_TRAIN = r"""
import sys
from cocoon_ckpt.embedding import engine, precompute
from cocoon_ckpt._cli.main import main

precompute.default_tile_rows = engine.default_tile_rows = lambda *a: TILE_ROWS
sys.exit(main(sys.argv[1:]))
""".replace("TILE_ROWS", str(TILE_ROWS))

_TILES = re.compile(r"table (\S+): precompute tiles loaded from the store: (\d+), computed: (\d+)")


def _args(store: Path, key: Path) -> list[str]:
    return [
        *("--log-level", "INFO", "train", "--example", "dlrm", "--store", str(store)),
        *("--key-file", str(key), "--steps", "8", "--bands", "4", "--embedding", "coalesced"),
        *("--hot-threshold", "3", "--threat-model", "final_model", "--checkpoint-every", "4"),
        *("--no-progress", "--sync-checkpoints"),
    ]


def _run(world: int, store: Path, key: Path, crash_at: str | None = None) -> list[tuple[int, str]]:
    """The job on `world` ranks (one process when 1), with torchrun's environment:
    each rank's exit code and stderr."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = rank_env(ENV, world, rank, port, crash_at)
        cmd = [sys.executable, "-c", _TRAIN, *_args(store, key)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    out = [(p.communicate(timeout=600)[1], p.returncode) for p in procs]
    if crash_at is None and any(code for _, code in out):
        raise AssertionError("\n".join(f"exit {code}:\n{err[-3000:]}" for err, code in out))
    return [(code, err) for err, code in out]


def _tiles(log: str) -> dict[str, tuple[int, int]]:
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _TILES.finditer(log)}


def _markers(store: Path) -> list[Path]:
    return sorted((store / "shared" / PRECOMPUTE).rglob("*.done"))


def _csc_bytes(store: Path) -> dict[str, list[bytes]]:
    v: Version | None = Store.open(str(store), create=False).latest()
    assert v is not None
    out = {}
    for table in records_of(v)["embedding"]["tables"]:
        csc = whole_csc(v, table["param"], table["csc"])
        out[table["param"]] = [a.tobytes() for a in csc.arrays().values()]
    return out


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[int, int]]]:
    """One process, uninterrupted: the store and each table's (loaded, computed) tiles."""
    root = tmp_path_factory.mktemp("precompute_ranks")
    [(code, err)] = _run(1, root / "gold.zarr", root / "k")
    tiles = _tiles(err)
    assert len(tiles) == 4 and all(loaded == 0 for loaded, _ in tiles.values())
    return root, tiles


def _killed(root: Path, name: str) -> Path:
    """A 2-rank job SIGKILLed on both ranks during its precompute, right after each
    rank's KILL_AT-th tile was durable."""
    store = root / name
    codes = _run(2, store, root / "k", f"precompute.tile_kept:step={KILL_AT}")
    assert [c for c, _ in codes] == [-signal.SIGKILL] * 2, [e[-2000:] for _, e in codes]
    assert not (store / "manifests").exists() or not list((store / "manifests").iterdir())
    marks = _markers(store)
    # each rank kept exactly its first tiles, in its own folder, none in one process's
    folders = sorted({m.parent.name for m in marks})
    assert len(marks) == 2 * KILL_AT and len(folders) == 2, marks
    assert all(re.fullmatch(r"g\d+-r000[01]", f) for f in folders)
    assert {f.rsplit("-", 1)[1] for f in folders} == {"r0000", "r0001"}
    return store


@pytest.mark.slow
def test_killed_during_the_precompute_on_two_ranks_resumes_on_two(
    gold: tuple[Path, dict[str, tuple[int, int]]],
) -> None:
    root, whole = gold
    store = _killed(root, "two.zarr")
    resumed = _run(2, store, root / "k")
    per_rank = [_tiles(err) for _, err in resumed]
    loaded = sum(t[0] for tiles in per_rank for t in tiles.values())
    computed = sum(t[1] for tiles in per_rank for t in tiles.values())
    # only what neither rank kept was computed again; every tile exactly once
    assert loaded == 2 * KILL_AT
    assert loaded + computed == sum(c for _, c in whole.values())
    assert not (store / "shared" / PRECOMPUTE).exists()  # a version holds the CSC now
    assert _csc_bytes(store) == _csc_bytes(root / "gold.zarr")


@pytest.mark.slow
def test_killed_during_the_precompute_on_two_ranks_resumes_in_one_process(
    gold: tuple[Path, dict[str, tuple[int, int]]],
) -> None:
    root, whole = gold
    store = _killed(root, "one.zarr")
    [(_, err)] = _run(1, store, root / "k")
    tiles = _tiles(err)
    # one process finds both ranks' tiles by their index among the table's tiles
    assert sum(t[0] for t in tiles.values()) == 2 * KILL_AT
    assert {p: sum(t) for p, t in tiles.items()} == {p: t[1] for p, t in whole.items()}
    assert not (store / "shared" / PRECOMPUTE).exists()
    assert _csc_bytes(store) == _csc_bytes(root / "gold.zarr")


def test_a_rank_keeps_no_tile_once_rank_zeros_lease_is_taken_over(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    lease = store.lease
    assert lease is not None
    gen = lease.generation
    # rank 1 of the job: no lease of its own, rank 0's generation
    rank1 = StoredTiles(
        Store.open(str(tmp_path / "s.zarr")), "emb.weight", "d" * 32, mac_key=bytes(32),
        rank=(gen, 1),
    )  # fmt: skip
    slots = np.arange(4, dtype=np.int64)
    entries = (np.zeros(4, np.int64), slots, np.ones((4, 2), np.float32))
    rank1.save(0, slots, entries)
    assert [m.parent.name for m in _markers(tmp_path / "s.zarr")] == [f"g{gen}-r0001"]
    Store.open(str(tmp_path / "s.zarr")).acquire_lease(takeover=True)  # a new job
    with pytest.raises(FencedError, match="taken over"):
        rank1.save(1, slots + 4, entries)
    assert len(_markers(tmp_path / "s.zarr")) == 1  # nothing written
