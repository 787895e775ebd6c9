"""Sharded noise on torch.distributed (gloo, CPU), with real processes: 2 and 4 ranks
add the single process's noise bit for bit; a rank killed mid-checkpoint leaves the
previous version newest and a restart resumes exactly; 4 -> 2 -> 4 ranks reshard."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.format.ring_rows import slot_refs, slot_values
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train.distributed import shard_bounds
from state import Store, Version

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train_args(store: Path, key: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        *("-m", "cocoon_ckpt", "train", "--example", "mlp", "--store", str(store)),
        *("--key-file", str(key), "--steps", "14", "--bands", "4"),
        *("--checkpoint-every", "4", "--no-progress", *extra),
    ]


def _torchrun(world: int, store: Path, key: Path) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(world), *_train_args(store, key)]
    return subprocess.run(cmd, env=ENV, capture_output=True, timeout=300).returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(
    world: int,
    store: Path,
    key: Path,
    crash: dict[int, str] | None = None,
    extra: tuple[str, ...] = (),
) -> list[int]:
    """The job's ranks started directly, with the environment torchrun gives them (no
    launcher process); their exit codes. `crash` arms COCOON_CRASH_AT per rank; `extra`
    are more `train` flags."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {
            **ENV,
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world)},
            **{"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)},
        }
        if crash and rank in crash:
            env["COCOON_CRASH_AT"] = crash[rank]
        procs.append(
            subprocess.Popen(
                [sys.executable, *_train_args(store, key, extra)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return [p.wait(timeout=300) for p in procs]


def _single(store: Path, key: Path, extra: tuple[str, ...] = ()) -> None:
    """The one-process run, in this process (one thread, as the ranks run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_train_args(store, key, extra)[2:]) == 0
    finally:
        torch.set_num_threads(threads)


def _latest(store: Path) -> Version:
    v = Store.open(str(store), create=False).latest()
    assert v is not None
    return v


def _ring(version: Version) -> dict[int, np.ndarray]:
    """Every stored w of the newest version, shards concatenated in coordinate order."""
    parts: dict[int, list[tuple[int, np.ndarray]]] = {}
    for shard in version.records["noise"]["shards"]:
        for ref in slot_refs(shard["slots"]):
            parts.setdefault(ref.step, []).append((shard["start"], slot_values(version, ref)))
    return {
        s: np.concatenate([a for _, a in sorted(p, key=lambda x: x[0])]) for s, p in parts.items()
    }


@given(dim=st.integers(1, 5 * BLOCK), world=st.integers(1, 8))
def test_shard_bounds_cover_the_dimension_in_whole_blocks(dim: int, world: int) -> None:
    bounds = shard_bounds(dim, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == dim
    assert all(a <= z for a, z in bounds)
    assert all(z == a2 for (_, z), (a2, _) in zip(bounds[:-1], bounds[1:], strict=True))
    if -(-dim // BLOCK) >= world:
        assert all(a % BLOCK == 0 for a, _ in bounds)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Uninterrupted runs of one job, one key: one process, 2 ranks, 4 ranks (launched
    by torchrun, as users launch them; the tests' own crash and restart legs start
    their ranks directly)."""
    root = tmp_path_factory.mktemp("dist")
    key = root / "k"
    _single(root / "one.zarr", key)
    for world in (2, 4):
        assert _torchrun(world, root / f"w{world}.zarr", key) == 0
    return root, key


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_add_the_single_process_noise(runs: tuple[Path, Path], world: int) -> None:
    root, _ = runs
    one, many = _latest(root / "one.zarr"), _latest(root / f"w{world}.zarr")
    assert len(many.records["noise"]["shards"]) == world
    ring_one, ring_many = _ring(one), _ring(many)
    assert ring_one.keys() == ring_many.keys()
    assert all(np.array_equal(ring_one[s], ring_many[s]) for s in ring_one)  # bit for bit
    a, b = model_state(one), model_state(many)
    # the clipped gradient sum is added per rank, then across ranks: reassociation only
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_rank_killed_mid_checkpoint_leaves_previous_version(runs: tuple[Path, Path]) -> None:
    root, key = runs
    gold = root / "w2.zarr"
    store = root / "crash2.zarr"
    # rank 1's arrays of version 2 are durable; the barrier is never reached
    codes = _ranks(2, store, key, crash={1: "checkpoint.shard_done:step=8"})
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    latest = _latest(store)
    assert latest.step == 4  # version 2 never became visible
    leftovers = [p.name for p in (store / "versions").iterdir() if p.name.startswith("00000002")]
    assert leftovers  # rank 1 wrote its part, which nothing references
    assert _ranks(2, store, key) == [0, 0]
    a, b = model_state(_latest(gold)), model_state(_latest(store))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for v in Store.open(str(store), create=False).versions():
        Store.open(str(store), create=False).read(v)  # every version verifies


def test_reshard_4_2_4(runs: tuple[Path, Path]) -> None:
    root, key = runs
    gold = root / "w4.zarr"
    store = root / "reshard.zarr"
    for world, step in ((4, 5), (2, 9)):
        crash = dict.fromkeys(range(world), f"trainer.after_update:step={step}")
        assert all(code != 0 for code in _ranks(world, store, key, crash))
    assert _latest(store).step == 8
    assert _ranks(4, store, key) == [0] * 4
    g, s = _latest(gold), _latest(store)
    assert len(s.records["noise"]["shards"]) == 4
    ring_g, ring_s = _ring(g), _ring(s)
    assert all(np.array_equal(ring_g[k], ring_s[k]) for k in ring_g)  # noise: bit for bit
    a, b = model_state(g), model_state(s)
    for k in a:  # steps 5-8 summed gradients over 2 ranks instead of 4
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
