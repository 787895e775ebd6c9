"""Ranks agree before anything is written (two real gloo processes per case): a rank given
its own key file, or alone given another clip, seed, sigma, target or step count, is
refused on every rank with one exit code and one line naming each differing field and
each rank's value (a key by its id only), and the tree of files (store, key files) is
byte for byte what it was; ranks given the same flags still train."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.keys import create_key_file, key_id, new_key
from cocoon_ckpt.train.build import checked_parts
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.rank_agreement import RankDisagreementError, agree_on
from cocoon_ckpt.train.runner import run_job
from cocoon_ckpt.train.start import start_ranks
from state import Store
from tests.cocoon_ckpt.conftest import job_config, tree
from tests.cocoon_ckpt.test_distributed import ENV, _free_port


def _args(store: Path, key: Path, *extra: str) -> list[str]:
    return [
        *("train", "--store", str(store), "--key-file", str(key), "--dataset-size", "512"),
        *("--steps", "6", "--bands", "2", "--checkpoint-every", "3", "--no-progress", *extra),
    ]


def _ranks(argvs: list[list[str]]) -> list[tuple[int, str]]:
    """Each rank's `cocoon-ckpt argv` started with torchrun's environment: its exit code
    and the last line of its stderr (the whole stderr on failure, in the assertion)."""
    port, world = str(_free_port()), str(len(argvs))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cocoon_ckpt", *argv],
            env={
                **ENV,
                **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": world},
                **{"RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": world},
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, argv in enumerate(argvs)
    ]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            lines = err.strip().splitlines()
            out.append((p.returncode, lines[-1] if lines else ""))
    finally:
        for p in procs:  # a rank left waiting in a collective for one that stopped
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _key(path: Path) -> str:
    """A new key file at `path`; its id."""
    key = new_key()
    create_key_file(str(path), key)
    return key_id(key)


#: (what rank 1 alone is given, the differing field with each rank's value)
_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "clip": (("--clip", "50"), "dp.max_grad_norm: rank 0 1.0, rank 1 50.0"),
    "seed": (("--seed", "7"), "dp.seed: rank 0 0, rank 1 7"),
    "sigma": (("--noise-multiplier", "0.5"), "dp.noise_multiplier: rank 0 1.0, rank 1 0.5"),
    "steps": (("--steps", "8"), "dp.steps: rank 0 6, rank 1 8"),
    # a target on rank 1 alone: refused before the calibration, which only it would enter
    "target": (
        ("--target-epsilon", "4"),
        "dp.noise_multiplier: rank 0 1.0, rank 1 null; dp.target_epsilon: rank 0 null, rank 1 4.0",
    ),
}


def _flag_case(name: str) -> Callable[[Path], tuple[list[list[str]], list[str]]]:
    extra, says = _FLAGS[name]

    def case(tmp: Path) -> tuple[list[list[str]], list[str]]:
        store, key = tmp / "run.zarr", tmp / "k"
        _key(key)  # an existing key, so only the flag differs
        return [_args(store, key), _args(store, key, *extra)], [says]

    return case


def _own_new_key_files(tmp: Path) -> tuple[list[list[str]], list[str]]:
    store = tmp / "run.zarr"
    argvs = [_args(store, tmp / f"k{r}") for r in range(2)]
    new = "a new key (rank 0 makes it) kept in key file"
    return argvs, [f"key: rank 0 {new} {tmp / 'k0'}, rank 1 {new} {tmp / 'k1'}"]


def _own_key_files_on_a_store(tmp: Path) -> tuple[list[list[str]], list[str]]:
    store = tmp / "run.zarr"
    ids = [_key(tmp / f"k{r}") for r in range(2)]
    assert main(_args(store, tmp / "k0")) == 0  # the store's job, run with rank 0's key
    argvs = [_args(store, tmp / f"k{r}") for r in range(2)]
    return argvs, [f"key: rank 0 key id {ids[0]}, rank 1 key id {ids[1]}"]


_CASES = {
    **{name: _flag_case(name) for name in _FLAGS},
    "own-new-key-files": _own_new_key_files,
    "own-key-files-on-a-store": _own_key_files_on_a_store,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
def test_ranks_that_disagree_are_refused_on_each_with_nothing_written(
    tmp_path: Path, case: str
) -> None:
    argvs, says = _CASES[case](tmp_path)
    before = tree(tmp_path)
    ranks = _ranks(argvs)
    assert [code for code, _ in ranks] == [2, 2], ranks  # a malformed request
    line = ranks[0][1]
    assert line.startswith("cocoon-ckpt: error: the 2 ranks of this job were not given"), line
    assert f"same job: {'; '.join(says)}. Only rank 0's" in line
    assert ranks[1][1] == line  # one message on every rank
    assert tree(tmp_path) == before  # no store, lease, key file or version written
    for key in tmp_path.glob("k*"):
        assert key.read_bytes().hex() not in line  # keys shown by id only


@pytest.mark.slow
def test_ranks_that_agree_still_train(tmp_path: Path) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    # a new key file on both (rank 0 makes it, rank 1 reads it and checks its id), and
    # per-rank fields that may differ: the log level and the gradient threads
    argvs = [["--log-level", "ERROR", *_args(store, key)], _args(store, key, "--grad-threads", "1")]
    assert [code for code, _ in _ranks(argvs)] == [0, 0]
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 6
    assert latest.records["key_id"] == key_id(key.read_bytes())


class _Gathered:
    """Rank `rank` of a job whose ranks computed `values` (one process)."""

    def __init__(self, rank: int, values: list[dict[str, str]]) -> None:
        self.rank, self.world, self.values = rank, len(values), values

    def gather_checked(self, compute: Callable[[], dict[str, str]]) -> list[dict[str, str]]:
        assert compute() == self.values[self.rank]
        return self.values


def test_three_ranks_list_every_value_and_a_field_one_lacks() -> None:
    values = [{"dp.seed": "0", "options.a": "1"}, {"dp.seed": "0"}, {"dp.seed": "7"}]
    for rank in range(3):
        ctx: DistContext = _Gathered(rank, values)  # type: ignore[assignment]
        with pytest.raises(RankDisagreementError) as caught:
            agree_on(ctx, lambda r=rank: values[r])  # type: ignore[misc]
        assert caught.value.differences == [
            "dp.seed: rank 0 0, rank 1 0, rank 2 7",
            "options.a: rank 0 1, rank 1 <absent>, rank 2 <absent>",
        ]


class _Rank1:
    """Rank 1 of 2 in one process: rank 0's start sent `coordinator_key_id` and version 0
    (no version: a new job), and rank 0's checks passed."""

    rank, world, is_coordinator = 1, 2, False
    agree = DistContext.agree
    from_coordinator = DistContext.from_coordinator

    def __init__(self, coordinator_key_id: str) -> None:
        self.sent = coordinator_key_id

    def broadcast_object(self, obj: object) -> object:
        return ("ok", (None, self.sent, None, False))  # version, key id, sigma, calibrated

    def all_gather_object(self, obj: object) -> list[object]:
        return [None, obj]


def test_a_rank_reading_another_key_after_rank_0_made_it_is_refused(tmp_path: Path) -> None:
    # rank 0 made a new key at the path every rank named; on rank 1's host that path
    # holds another key (no shared disk): refused by id once rank 1 reads it
    url, key = str(tmp_path / "run.zarr"), tmp_path / "k"
    config = job_config("mlp", bands=2, steps=4)
    run_job(config, url, options=JobOptions(key_file=str(key)))
    coordinator = key_id(bytes(32))
    before = tree(tmp_path)
    rank1: DistContext = _Rank1(coordinator)  # type: ignore[assignment]
    with pytest.raises(RankDisagreementError) as caught:
        start_ranks(
            config,
            url,
            rank1,
            lambda: checked_parts(config, None),  # checked before this under ranks: not called
            JobOptions(key_file=str(key)),
        )
    mine = key_id(key.read_bytes())
    assert caught.value.differences == [f"key: rank 0 key id {coordinator}, rank 1 key id {mine}"]
    assert tree(tmp_path) == before  # rank 1 writes nothing
