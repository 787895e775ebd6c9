"""Refusals and sigma calibration on torch.distributed (gloo, CPU), with real processes:
a bad job (wrong optimizer, wrong dataset size on every rank or on one) is refused on
every rank with one exit code and one message before anything is written; a refusal of
the coordinator's start reaches the other ranks as itself; a target epsilon is
calibrated once, on rank 0, and every rank trains with its sigma, the single process's.
The trainer refuses embedding noise on ranks with the start's own check; on one rank it
trains as one process, bit for bit. A refusal on one rank alone after rank 0's start (its
data's digest, its key file) stops every rank, rank 0's lease released."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train.build import checked_parts, job_parts
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.rank_failure import packed, unpacked
from cocoon_ckpt.train.runner import run_job
from cocoon_ckpt.train.start import start_ranks
from cocoon_ckpt.train.trainer import DPTrainer
from state import CorruptVersionError, Store
from tests.cocoon_ckpt.conftest import job_config
from tests.cocoon_ckpt.test_distributed import ENV, _free_port

#: Counts each calibration in a file (argv[1]), then runs the CLI (argv[2:]).
_COUNTING = """
import sys
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.train import target_epsilon as te
def counted(real):
    def run(*args):
        with open(sys.argv[1], "a") as f:
            f.write(real.__name__ + "\\n")
        return real(*args)
    return run
te.noise_multiplier_for = counted(te.noise_multiplier_for)
te.blt_noise_multiplier = counted(te.blt_noise_multiplier)
sys.exit(main(sys.argv[2:]))
"""


#: One embedding job run twice in a child: alone, then as rank 0 of a group of 1.
_ONE_RANK = """
import socket, sys
import torch, torch.distributed as dist
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.train.runner import JobOptions, run_job
from tests.cocoon_ckpt.conftest import job_config
root = sys.argv[1]
config = job_config("dlrm", bands=4, steps=10, embedding=EmbeddingConfig())
torch.set_num_threads(1)
run_job(config, root + "/one.zarr", options=JobOptions(key_file=root + "/k"))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
run_job(config, root + "/rank.zarr", options=JobOptions(key_file=root + "/k"))
"""


def _args(store: Path, key: Path, *extra: str) -> list[str]:
    return [
        *("train", "--store", str(store), "--key-file", str(key)),
        *("--steps", "6", "--bands", "2", "--checkpoint-every", "3", "--no-progress", *extra),
    ]


def _job(store: Path, key: Path, fault: str, *extra: str) -> list[str]:
    job = ("--job", "tests.cocoon_ckpt.rank_jobs:build", "--job-option", f"fault={fault}")
    return _args(store, key, *job, *extra)


class _Exit(tuple):  # type: ignore[type-arg]
    """A rank's (exit code, last stderr line), equal to that pair; its repr carries the
    tail of the whole stderr, so a failed comparison shows why a rank ended (a rank
    that aborted after the agreed error printed its reason above its last line)."""

    stderr: str

    def __new__(cls, code: int, stderr: str) -> _Exit:
        text = stderr.strip()
        out = super().__new__(cls, (code, text.splitlines()[-1] if text else ""))
        out.stderr = text
        return out

    def __repr__(self) -> str:
        return f"{tuple(self)!r} [stderr ends: {self.stderr[-3000:]!r}]"


def _ranks(world: int, argv: list[str], counts: Path | None = None) -> list[tuple[int, str]]:
    """The ranks of `cocoon-ckpt argv`, started with torchrun's environment; each one's
    exit code and stderr. `counts`: each rank counts its calibrations in `counts.<rank>`."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {
            **ENV,
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world)},
            **{"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)},
        }
        cmd = [sys.executable, "-m", "cocoon_ckpt", *argv]
        if counts is not None:
            cmd = [sys.executable, "-c", _COUNTING, f"{counts}.{rank}", *argv]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        out.append(_Exit(p.returncode, err))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "extra", "code", "says"),
    [
        # the job's own Adam is the record unless a flag says otherwise: then it is refused
        ("optimizer", ("--optimizer", "sgd"), 2, "the job's optimizer is Adam"),
        # one rank's parts alone are wrong: the coordinator, whose are right, stops too
        (
            "dataset",
            ("--job-option", "fault_rank=1"),
            2,
            "but the dataset holds len(dataset)=511",
        ),
        # a model the trainer refuses when built: refused before the coordinator writes
        ("half", (), 2, "trainable parameters must be float32/float64"),
    ],
    ids=["optimizer", "dataset-on-rank-1", "half"],
)
def test_a_bad_job_on_2_ranks_is_refused_on_each_before_any_write(
    tmp_path: Path, fault: str, extra: tuple[str, ...], code: int, says: str
) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    ranks = _ranks(2, _job(store, key, fault, "--dataset-size", "512", *extra))
    assert [c for c, _ in ranks] == [code, code], ranks
    line = ranks[0][1]
    assert line.startswith("cocoon-ckpt: error: ") and says in line
    assert ranks[1][1] == line  # one message, the failing rank's
    assert not store.exists() and not key.exists()


@pytest.mark.slow
def test_a_refused_coordinator_start_reaches_every_rank_as_itself(tmp_path: Path) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    assert main(_args(store, key)) == 0
    before = sorted(p.name for p in (store / "versions").iterdir())
    ranks = _ranks(2, _args(store, key, "--seed", "7"))  # the store's job had seed 0
    # a ConfigMismatchError on each (a valid request refused: exit 1), rank 0's message
    assert [code for code, _ in ranks] == [1, 1], ranks
    assert "seed" in ranks[0][1] and ranks[1][1] == ranks[0][1]
    assert sorted(p.name for p in (store / "versions").iterdir()) == before


@pytest.mark.slow
def test_a_resume_refused_on_one_rank_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    store, key = tmp_path / "run.zarr", tmp_path / "k"
    argv = _job(store, key, "content", "--dataset-size", "512", "--job-option", "fault_rank=1")
    assert main(argv) == 0  # one process: rank 0's data, unshifted
    before = sorted(p.name for p in (store / "versions").iterdir())
    ranks = _ranks(2, argv)  # rank 1's data shifted: its digest differs from the store's
    # rank 0, whose data matches, stops with rank 1's refusal instead of a gloo error
    assert ranks[0][0] == ranks[1][0] != 0, ranks
    assert "dataset.digest" in ranks[0][1] and ranks[1][1] == ranks[0][1]
    assert sorted(p.name for p in (store / "versions").iterdir()) == before


class _Rank0:
    """Rank 0 of 2 in one process; rank 1 reports `theirs` when the ranks agree."""

    rank, world, is_coordinator = 0, 2, True
    agree = DistContext.agree
    from_coordinator = DistContext.from_coordinator

    def __init__(self, theirs: BaseException | None) -> None:
        self.theirs = theirs

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, None if self.theirs is None else packed(self.theirs)]


def test_a_rank_that_cannot_open_the_store_stops_the_coordinator_lease_released(
    tmp_path: Path,
) -> None:
    url, key = str(tmp_path / "run.zarr"), tmp_path / "k"
    config = job_config("mlp", bands=2, steps=4)
    run_job(config, url, options=JobOptions(key_file=str(key)))
    # rank 1's host has no key file where the job names one
    missing = FileNotFoundError(2, "No such file or directory", str(key))
    rank0: Any = _Rank0(missing)
    with pytest.raises(FileNotFoundError) as caught:
        start_ranks(
            config,
            url,
            rank0,
            lambda: checked_parts(config, None),  # checked before this under ranks: not called
            JobOptions(key_file=str(key)),
        )
    assert str(caught.value) == str(missing)  # rank 1's error, path included
    holder = Store.open(url, create=False).lease_holder()
    assert holder is not None and holder["generation"] == 2  # this start's lease ...
    assert holder["released"]  # ... released by rank 0


@pytest.mark.slow
def test_a_target_epsilon_on_2_ranks_is_calibrated_once_to_the_single_process_sigma(
    tmp_path: Path,
) -> None:
    one, key = tmp_path / "one.zarr", tmp_path / "k"
    target = ("--target-epsilon", "4")
    assert main(_args(one, key, *target)) == 0
    many, counts = tmp_path / "two.zarr", tmp_path / "calls"
    assert [code for code, _ in _ranks(2, _args(many, key, *target), counts)] == [0, 0]
    # rank 0 calibrated once, for the CLI's config: the job it opened finds the sigma
    # calibrated already; rank 1 never calibrated
    assert Path(f"{counts}.0").read_text().split() == ["noise_multiplier_for"]
    assert not Path(f"{counts}.1").exists()
    dp_one, dp_many = (
        Store.open(str(s), create=False).latest().records["config"]["dp"]  # type: ignore[union-attr]
        for s in (one, many)
    )
    assert dp_many["noise_multiplier"] == dp_one["noise_multiplier"]  # the same float
    assert dp_many["target_epsilon"] == 4.0


def test_a_failure_travels_as_its_class_message_and_attributes() -> None:
    for exc in (
        ConfigMismatchError("run.zarr: seed differs", ["dp.seed: stored 0, now 7"]),
        CorruptVersionError("version 3 is damaged", version=3, path="versions/3"),
        ConfigError("DPConfig.steps=0"),
    ):
        got = unpacked(packed(exc))
        assert type(got) is type(exc) and str(got) == str(exc)
        assert got.__dict__ == exc.__dict__

    class Local(ValueError):  # a job's own class, which pickle cannot name
        pass

    got = unpacked(packed(Local("bad rows")))
    assert type(got) is ConfigError and str(got) == "Local: bad rows"  # exit 2 either way


@pytest.mark.parametrize("world", [1, 2])
def test_the_trainer_refuses_embedding_noise_on_ranks_as_the_start_does(world: int) -> None:
    config = job_config("dlrm", bands=4, embedding=EmbeddingConfig())
    parts = job_parts(config, None)
    emb = EmbeddingConfig(tables=tuple(parts.tables))

    def trainer() -> DPTrainer:
        assert parts.dataset is not None
        return DPTrainer(
            parts.model,
            parts.optimizer,
            parts.loss_fn,
            parts.dataset,
            config.dp,
            bytes(32),
            embedding=emb,
            dist=DistContext(0, world),
        )

    if world > 1:
        with pytest.raises(ConfigError, match="embedding noise with torch.distributed"):
            trainer()
        return
    trainer().close()  # one rank is one process: check_distributed lets it run


@pytest.mark.slow
def test_embedding_noise_on_one_rank_trains_as_one_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RANK, str(tmp_path)], env=ENV, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    one, rank = (
        Store.open(str(tmp_path / n), create=False).latest() for n in ("one.zarr", "rank.zarr")
    )
    assert one is not None and rank is not None
    want, got = model_state(one), model_state(rank)
    assert want.keys() == got.keys()
    assert all(torch.equal(torch.as_tensor(want[k]), torch.as_tensor(got[k])) for k in want)
