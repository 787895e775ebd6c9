"""Lazy embedding noise (b = 1) on torch.distributed (gloo, CPU), with real processes:
2 ranks draw the one process's lazy updates bit for bit and train the same model up to
the association of the gradient sums; a job killed on 2 ranks resumes on 1 and on 3 with
the same draws; dense table noise stays refused on more than one rank (coalesced noise
runs there: tests/cocoon_ckpt/test_distributed_coalesced.py).

Each process runs the real `train` command in a child interpreter that records a
digest of every lazy draw it applies (`LazyNoise.updates`, after the ranks' gather)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.lazy import share_counts
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train.distributed import check_distributed
from state import Store, Version
from tests.cocoon_ckpt.rank_jobs import free_port, rank_env

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 12

#: The `train` command in this interpreter, each lazy draw's digest (and its norm, so a
#: draw of zeros would show) appended to the file named by argv[1], one JSON per line.
_RECORDING = r"""
import hashlib, json, sys
import numpy as np
from cocoon_ckpt.embedding import lazy
from cocoon_ckpt._cli.main import main

log = open(sys.argv[1], "a")
updates = lazy.LazyNoise.updates

def recorded(self, *args):
    out = updates(self, *args)
    a = np.ascontiguousarray(out)
    log.write(json.dumps([hashlib.sha256(a.tobytes()).hexdigest(), a.shape[0],
                          float(np.linalg.norm(a))]) + "\n")
    log.flush()
    return out

lazy.LazyNoise.updates = recorded
sys.exit(main(sys.argv[2:]))
"""


def _train_args(store: Path, key: Path, mode: str = "lazy", bands: int = 1) -> list[str]:
    return [
        *("train", "--example", "dlrm", "--store", str(store), "--key-file", str(key)),
        *("--steps", str(STEPS), "--bands", str(bands), "--embedding", mode),
        *("--threat-model", "final_model", "--checkpoint-every", "4", "--no-progress"),
    ]


def _run(
    world: int,
    store: Path,
    key: Path,
    logs: Path,
    crash_at: str | None = None,
    args: list[str] | None = None,
) -> list[int]:
    """The job on `world` ranks (one process when 1), started with the environment
    torchrun gives them; rank r's draws logged to `logs`-r.jsonl, its stderr to
    `logs`-r.err; their exit codes. `args`: other `train` arguments, whose failure is
    expected (as with `crash_at`)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = rank_env(ENV, world, rank, port, crash_at)
        train = args if args is not None else _train_args(store, key)
        cmd = [sys.executable, "-c", _RECORDING, f"{logs}-{rank}.jsonl", *train]
        with open(f"{logs}-{rank}.err", "wb") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
    codes = [p.wait(timeout=600) for p in procs]
    if crash_at is None and args is None and any(codes):
        errs = [Path(f"{logs}-{r}.err").read_text()[-3000:] for r in range(world)]
        raise AssertionError(f"exit codes {codes}:\n" + "\n".join(errs))
    return codes


def _draws(logs: Path, rank: int = 0) -> list[list[object]]:
    return [json.loads(line) for line in Path(f"{logs}-{rank}.jsonl").read_text().splitlines()]


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted runs of one job, one key: one process and 2 ranks."""
    root = tmp_path_factory.mktemp("lazy_ranks")
    _run(1, root / "one.zarr", root / "k", root / "one")
    _run(2, root / "two.zarr", root / "k", root / "two")
    return root


@pytest.mark.slow
def test_two_ranks_draw_the_one_process_lazy_noise(runs: Path) -> None:
    one = _draws(runs / "one")
    # step 0's draws are of empty gaps (zeros); every later one carries noise
    assert len(one) > STEPS and sum(float(str(n)) > 0 for _, _, n in one) > len(one) // 2
    assert _draws(runs / "two", 0) == one  # bit for bit, every draw and the tails
    assert _draws(runs / "two", 1) == one  # every rank applies every row's draw
    a, b = _latest(runs / "one.zarr"), _latest(runs / "two.zarr")
    assert a.step == b.step == STEPS and b.records["complete"]
    _close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_killed_on_two_ranks_resumes_on_another_world_size(runs: Path, world: int) -> None:
    store, key = runs / f"resume{world}.zarr", runs / "k"
    codes = _run(2, store, key, runs / f"killed{world}", crash_at="trainer.after_update:step=6")
    assert all(code != 0 for code in codes)
    assert _latest(store).step == 4  # the version of step 8 never came
    _run(world, store, key, runs / f"resumed{world}")
    one, killed = _draws(runs / "one"), _draws(runs / f"killed{world}")
    resumed = [_draws(runs / f"resumed{world}", r) for r in range(world)]
    # the killed run drew steps 0-6, the resumed one steps 4 to the tails: both are the
    # uninterrupted run's draws
    assert killed == one[: len(killed)] and len(killed) < len(one)
    assert all(r == one[len(one) - len(r) :] for r in resumed)
    assert len(killed) + len(resumed[0]) > len(one)  # they overlap in steps 4-6
    _close(_latest(runs / "one.zarr"), _latest(store))
    audit = [sys.executable, "-m", "cocoon_ckpt", "audit", str(store), "--key-file", str(key)]
    done = subprocess.run([*audit, "--example", "dlrm"], env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-2000:]  # every version verifies


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("k", [0, 1, 5, 64, 1001])
def test_share_counts_split_every_row_once(world: int, k: int) -> None:
    counts = share_counts(k, world)
    assert sum(counts) == k and len(counts) == world
    assert counts == [a.size for a in np.array_split(np.arange(k), world)]


@pytest.mark.parametrize(
    ("mode", "bands", "threat"),
    [
        (TableMode.DENSE, 4, "final_model"),
        (TableMode.DENSE, 1, "final_model"),
        (TableMode.AUTO, 1, "intermediate_iterates"),
        (TableMode.AUTO, 4, "intermediate_iterates"),
    ],
)
def test_dense_table_noise_is_refused_on_ranks(mode: TableMode, bands: int, threat: str) -> None:
    emb = EmbeddingConfig(mode=mode, threat_model=threat, hot_threshold=3)
    with pytest.raises(ConfigError, match="supported for lazy and coalesced noise only") as err:
        check_distributed(emb, 2, bands)
    assert "\n" not in str(err.value) and "--embedding lazy --bands 1" in str(err.value)
    check_distributed(emb, 1, bands)  # one rank runs it as one process
    lazy = EmbeddingConfig(mode=TableMode.LAZY, threat_model="final_model")
    check_distributed(lazy, 2, 1)
    check_distributed(EmbeddingConfig(threat_model="final_model"), 2, 1)  # auto: lazy at b=1


@pytest.mark.slow
def test_dense_table_noise_on_two_ranks_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    logs = tmp_path / "c"
    codes = _run(2, store, key, logs, args=_train_args(store, key, "dense", 4))
    assert codes == [2, 2]  # a malformed request, on every rank
    for rank in range(2):
        err = Path(f"{logs}-{rank}.err").read_text()
        lines = [ln for ln in err.splitlines() if "supported for lazy and coalesced" in ln]
        assert len(lines) == 1 and "--embedding lazy --bands 1" in lines[0]
    assert not store.exists() and not key.exists()
