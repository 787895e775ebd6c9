"""Coalesced embedding noise (b > 1, precomputed CSC) on torch.distributed (gloo, CPU),
with real processes: 2 ranks, each precomputing and holding only its part of each
table's CSC, apply the one process's entries bit for bit and train the same model up
to the association of the gradient sums; a job killed (SIGKILL) on 2 ranks resumes on 1,
and one killed on 1 resumes on 2, with the same entries; what still cannot run on
several ranks is refused, naming the field.

Each process runs the real `train` command in a child interpreter that records a
digest of every CSC column it applies (`TableEngine._apply`, after the ranks' gather),
with tiles of 32 rows so every table's cold slots split into several tiles and both
ranks hold a part."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cocoon_ckpt import BandMF
from cocoon_ckpt.embedding import AccessSchedule, TableEngine, TablePlan, TableSpec
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.csc_shards import (
    CscPart,
    merge,
    part_bounds,
    restrict,
    tile_edges,
    whole_csc,
)
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.format.stored import model_state, records_of
from cocoon_ckpt.train.distributed import check_distributed
from state import Store, Version
from tests.cocoon_ckpt.rank_jobs import free_port, rank_env

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 12
TILE_ROWS = 32

#: The `train` command in this interpreter with precompute tiles of TILE_ROWS rows, each
#: applied CSC column's digest (rows and values) appended to the file named by argv[1].
_RECORDING = r"""
import hashlib, json, sys
import numpy as np
from cocoon_ckpt.embedding import engine, precompute
from cocoon_ckpt._cli.main import main

precompute.default_tile_rows = engine.default_tile_rows = lambda *a: TILE_ROWS
log = open(sys.argv[1], "a")
apply = engine.TableEngine._apply

def recorded(self, weight, rows, vals):
    h = hashlib.sha256(np.ascontiguousarray(rows).tobytes())
    h.update(np.ascontiguousarray(vals).tobytes())
    log.write(json.dumps([self.spec.param, h.hexdigest(), int(rows.size)]) + "\n")
    log.flush()
    return apply(self, weight, rows, vals)

engine.TableEngine._apply = recorded
sys.exit(main(sys.argv[2:]))
""".replace("TILE_ROWS", str(TILE_ROWS))


def _train_args(store: Path, key: Path, *extra: str) -> list[str]:
    return [
        *("train", "--example", "dlrm", "--store", str(store), "--key-file", str(key)),
        *("--steps", str(STEPS), "--bands", "4", "--embedding", "coalesced"),
        *("--hot-threshold", "3", "--threat-model", "final_model"),
        *("--checkpoint-every", "4", "--no-progress", *extra),
    ]


def _run(
    world: int,
    store: Path,
    key: Path,
    logs: Path,
    crash_at: str | None = None,
    args: list[str] | None = None,
    fails: bool = False,
) -> list[int]:
    """The job on `world` ranks (one process when 1), started with the environment
    torchrun gives them; rank r's applied columns logged to `logs`-r.jsonl, its stderr
    to `logs`-r.err; their exit codes. `args`: other `train` arguments; `fails`: a
    failure is expected (as with `crash_at`)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = rank_env(ENV, world, rank, port, crash_at)
        train = args if args is not None else _train_args(store, key)
        cmd = [sys.executable, "-c", _RECORDING, f"{logs}-{rank}.jsonl", *train]
        with open(f"{logs}-{rank}.err", "wb") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
    codes = [p.wait(timeout=600) for p in procs]
    if crash_at is None and not fails and any(codes):
        errs = [Path(f"{logs}-{r}.err").read_text()[-3000:] for r in range(world)]
        raise AssertionError(f"exit codes {codes}:\n" + "\n".join(errs))
    return codes


def _columns(logs: Path, rank: int = 0) -> list[list[object]]:
    path = Path(f"{logs}-{rank}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _latest(store: Path) -> Version:
    v = Store.open(str(store), create=False).latest()
    assert v is not None
    return v


def _close(a: Version, b: Version) -> None:
    """The same model up to the association of the per-row and dense gradient sums."""
    x, y = model_state(a), model_state(b)
    assert x.keys() == y.keys()
    for k in x:
        torch.testing.assert_close(
            torch.as_tensor(y[k]), torch.as_tensor(x[k]), rtol=1e-5, atol=1e-6
        )


def _tables(v: Version) -> list[dict[str, Any]]:
    return list(records_of(v)["embedding"]["tables"])


def _whole_csc(v: Version, table: dict[str, Any]) -> CoalescedCSC:
    return whole_csc(v, table["param"], table["csc"])


def _same_csc(a: CoalescedCSC, b: CoalescedCSC) -> None:
    for x, y in zip(a.arrays().values(), b.arrays().values(), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted runs of one job, one key: one process and 2 ranks."""
    root = tmp_path_factory.mktemp("coalesced_ranks")
    _run(1, root / "one.zarr", root / "k", root / "one")
    _run(2, root / "two.zarr", root / "k", root / "two")
    return root


@pytest.mark.slow
def test_two_ranks_apply_the_one_process_coalesced_noise(runs: Path) -> None:
    one = _columns(runs / "one")
    # every step's column of every table, and the tails; most carry entries
    assert len(one) == 4 * (STEPS + 1) and sum(int(str(c[2])) > 0 for c in one) > len(one) // 2
    assert _columns(runs / "two", 0) == one  # bit for bit, every column and the tails
    assert _columns(runs / "two", 1) == one  # every rank applies every entry
    a, b = _latest(runs / "one.zarr"), _latest(runs / "two.zarr")
    assert a.step == b.step == STEPS and b.records["complete"]
    _close(a, b)
    # each rank held its part: the 2-rank version lists two parts per table, whose
    # entries merged are the one process's CSC bit for bit (I5 rests on these bits)
    for ta, tb in zip(_tables(a), _tables(b), strict=True):
        parts = tb["csc"]["parts"]
        assert "parts" not in ta["csc"]
        assert len(parts) == 2 and all(p["entries"] > 0 for p in parts)
        assert parts[0]["stop"] == parts[1]["start"]
        assert tb["csc"]["entries"] == ta["csc"]["entries"] == sum(p["entries"] for p in parts)
        _same_csc(_whole_csc(a, ta), _whole_csc(b, tb))
        # the hot rows' online ring: the same plan and the same stored rows
        assert (ta["plan"], ta["online_rows"]) == (tb["plan"], tb["online_rows"])
        assert ta["online_rows"] > 0 and len(ta["slots"]) == len(tb["slots"]) > 0
        for sa, sb in zip(ta["slots"], tb["slots"], strict=True):
            assert sa[:2] == sb[:2]
            x, y = np.asarray(a.array(sa[2]))[sa[3]], np.asarray(b.array(sb[2]))[sb[3]]
            assert np.array_equal(x, y)
    # audit reads the parts: the schedule's cold reads and random entries recomputed
    audit = [sys.executable, "-m", "cocoon_ckpt", "audit", str(runs / "two.zarr")]
    audit += ["--key-file", str(runs / "k"), "--example", "dlrm"]
    done = subprocess.run(audit, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "FINDING" not in done.stdout and "bit_identical=" in done.stdout


@pytest.mark.slow
def test_killed_on_two_ranks_resumes_on_one(runs: Path) -> None:
    store, key = runs / "resume1.zarr", runs / "k"
    codes = _run(2, store, key, runs / "killed1", crash_at="trainer.after_update:step=6")
    assert all(code != 0 for code in codes) and -signal.SIGKILL in codes
    v = _latest(store)
    assert v.step == 4  # the version of step 8 never came
    assert all("parts" in t["csc"] for t in _tables(v))
    _run(1, store, key, runs / "resumed1")
    one, killed = _columns(runs / "one"), _columns(runs / "killed1")
    resumed = _columns(runs / "resumed1")
    # the killed run applied steps 0-6, the resumed one steps 4 to the tails: both are
    # the uninterrupted run's columns
    assert killed == one[: len(killed)] and len(killed) < len(one)
    assert resumed == one[len(one) - len(resumed) :]
    assert len(killed) + len(resumed) > len(one)  # they overlap in steps 4-6
    end = _latest(store)
    _close(_latest(runs / "one.zarr"), end)
    for ta, te in zip(_tables(_latest(runs / "one.zarr")), _tables(end), strict=True):
        # one process wrote the whole CSC again, from the parts: the one process's bits
        assert "parts" not in te["csc"]
        _same_csc(_whole_csc(_latest(runs / "one.zarr"), ta), _whole_csc(end, te))


@pytest.mark.slow
def test_killed_on_one_process_resumes_on_two_ranks(runs: Path) -> None:
    store, key = runs / "resume2.zarr", runs / "k"
    sync = _train_args(store, key, "--sync-checkpoints")  # step 4's version is committed
    codes = _run(1, store, key, runs / "killed2", "trainer.after_update:step=6", sync)
    assert codes == [-signal.SIGKILL]
    assert _latest(store).step == 4
    _run(2, store, key, runs / "resumed2", args=sync)
    one, killed = _columns(runs / "one"), _columns(runs / "killed2")
    resumed = [_columns(runs / "resumed2", r) for r in range(2)]
    assert killed == one[: len(killed)]
    assert all(r == one[len(one) - len(r) :] for r in resumed)
    assert len(killed) + len(resumed[0]) > len(one)
    _close(_latest(runs / "one.zarr"), _latest(store))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize(("hot", "rows", "tile"), [(0, 100, 32), (7, 500, 32), (40, 41, 8)])
def test_parts_are_whole_tiles_that_split_every_cold_slot_once(
    world: int, hot: int, rows: int, tile: int
) -> None:
    bounds = part_bounds(hot, rows, tile, world)
    edges = tile_edges(hot, rows, tile)
    assert len(bounds) == world and bounds[0][0] == hot and bounds[-1][1] == rows
    assert all(a == z0 for (_, z0), (a, _) in zip(bounds[:-1], bounds[1:], strict=False))
    assert all(a in edges and z in edges for a, z in bounds)


class _Rank:
    """Rank `rank` of `world`, without a process group: the precompute needs none."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_gather_object(self, obj: Any) -> list[Any]:
        raise AssertionError("the precompute is not a collective")


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_each_rank_precomputes_its_part_of_the_one_process_csc(world: int, offset: int) -> None:
    rng = np.random.default_rng(0)
    rows, steps, dim, hot = 90, 10, 3, 5  # tiles of 16: [5, 16), ..., [80, 90): 6 tiles
    sched = AccessSchedule.from_step_rows(rows, [rng.choice(rows, 12) for _ in range(steps)])
    mech = BandMF.banded_sqrt(4, steps)

    def engine() -> TableEngine:
        plan = TablePlan(TableMode.COALESCED, hot, None, {})
        spec = TableSpec(param="emb.weight", data_index=0, column=0)
        factors = np.full(steps, 0.1)
        return TableEngine(
            spec, rows, dim, mech, bytes(32), 0.7, torch.float64, sched, factors, plan, 16
        )

    whole = engine().precompute()
    parts = []
    for rank in range(world):
        e = engine()
        e.shard(_Rank(rank, world), offset)
        part = e.precompute()
        assert isinstance(part, CscPart)
        parts.append(part)
    # every run of tiles is held by exactly one rank (one run is empty at 7 ranks)
    assert sorted((p.start, p.stop) for p in parts) == sorted(parts[0].bounds)
    for p in parts:
        assert p.nnz == p.entries[p.bounds.index((p.start, p.stop))]
    assert sum(parts[0].entries) == whole.nnz
    _same_csc(merge(steps, parts, dim, whole.values.dtype), whole)


def test_restricted_parts_merge_to_the_whole_csc() -> None:
    rng = np.random.default_rng(3)
    n, rows, dim = 6, 40, 3
    cols = np.repeat(np.arange(n + 1), 10)
    rws = np.concatenate([rng.choice(rows, 10, replace=False) for _ in range(n + 1)])
    whole = CoalescedCSC.from_entries(n, cols, rws, rng.standard_normal((cols.size, dim)))
    slot_of = rng.permutation(rows)
    for cuts in ([0, 40], [0, 13, 40], [0, 5, 6, 30, 40]):
        parts = [restrict(whole, slot_of, a, z) for a, z in zip(cuts[:-1], cuts[1:], strict=False)]
        assert sum(p.nnz for p in parts) == whole.nnz
        _same_csc(merge(n, parts, dim, whole.values.dtype), whole)


@pytest.mark.parametrize(
    ("emb", "bands", "field"),
    [
        (EmbeddingConfig(mode=TableMode.DENSE, threat_model="final_model"), 4, "mode='dense'"),
        (EmbeddingConfig(mode=TableMode.AUTO), 4, "intermediate_iterates"),
        (
            EmbeddingConfig(mode=TableMode.COALESCED, threat_model="final_model"),
            4,
            "hot_threshold",
        ),
    ],
)
def test_what_does_not_shard_is_refused_naming_the_field(
    emb: EmbeddingConfig, bands: int, field: str
) -> None:
    with pytest.raises(ConfigError, match=field) as err:
        check_distributed(emb, 2, bands)
    assert "\n" not in str(err.value)
    check_distributed(emb, 1, bands)  # one rank runs it as one process
    ok = EmbeddingConfig(mode=TableMode.COALESCED, threat_model="final_model", hot_threshold=3)
    check_distributed(ok, 2, 4)
    check_distributed(EmbeddingConfig(threat_model="final_model", hot_threshold=3), 2, 4)
    # each rank reads its own part in windows (tests/.../test_distributed_csc_windows.py)
    check_distributed(dataclasses.replace(ok, csc_window_steps=4), 2, 4)


@pytest.mark.slow
def test_coalesced_without_a_threshold_on_two_ranks_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    logs = tmp_path / "c"
    args = [a for a in _train_args(store, key) if a not in ("--hot-threshold", "3")]
    codes = _run(2, store, key, logs, args=args, fails=True)
    assert codes == [2, 2]  # a malformed request, on every rank
    for rank in range(2):
        err = Path(f"{logs}-{rank}.err").read_text()
        lines = [ln for ln in err.splitlines() if "hot_threshold" in ln]
        assert len(lines) == 1 and "--hot-threshold" in lines[0]
    assert not store.exists() and not key.exists()


#: Two ranks that start their group through the library and leave by the interpreter's
#: ordinary exit, rank 0 first and by an exception (SystemExit 2); a handler registered
#: before the group (so run after the library's) prints whether it is still up.
_LEAVING = r"""
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("group up at exit:", dist.is_initialized(), flush=True))
from cocoon_ckpt.train.distributed import DistContext
ctx = DistContext.from_env()
ctx.barrier()
if ctx.rank == 0:
    sys.exit(2)
ctx = None
"""


def test_a_group_the_library_started_is_destroyed_on_every_exit(tmp_path: Path) -> None:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _LEAVING], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 0]  # no rank aborted (-6)
    assert all(out.strip() == "group up at exit: False" for out in outs), outs
