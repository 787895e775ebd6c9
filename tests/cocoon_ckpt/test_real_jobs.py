"""Real training jobs: a map-style Dataset, a physical batch, an LR scheduler and the
user's own stateful parts, resumed exactly; and every real object that changes the
result fingerprinted, a resume that would change one refused."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt.dp.generator import NoiseRng, generator_backend
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError, GeneratorMismatchError
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.format.codec import decode
from cocoon_ckpt.format.part_state import decode_part_state, encode_part_state
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.config import NOISE_RNGS, OPTIMIZERS
from cocoon_ckpt.train.lr_schedule import lr_schedule_ahead
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.trainer import DPTrainer
from state import Store

from .conftest import job_config
from .real_job import Pairs

KEY = bytes(range(32))


class EMA:
    """Exponential moving average of a model's weights, and a step counter."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.count = 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow), "count": self.count, "decay": (self.decay,)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.count = int(state["count"])
        (self.decay,) = state["decay"]


def builder(
    *, momentum: float = 0.9, gamma: float = 0.5, shift: float = 0.0
) -> Callable[[JobConfig], JobParts]:
    """The mlp example as a user writes it: a Dataset, SGD with momentum, StepLR, an EMA."""

    def build(config: JobConfig) -> JobParts:
        base = mlp.build(config)
        x, y = base.dataset  # type: ignore[misc]
        opt = torch.optim.SGD(base.model.parameters(), lr=config.lr, momentum=momentum)
        return JobParts(
            model=base.model,
            optimizer=opt,
            loss_fn=base.loss_fn,
            dataset=Pairs(x + shift, y),
            scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=gamma),
            stateful={"ema": EMA(base.model)},
        )

    return build


def _config(**dp: Any) -> JobConfig:
    cfg = job_config("mlp", bands=4, steps=16)
    return dataclasses.replace(
        cfg, dp=dataclasses.replace(cfg.dp, **{"physical_batch_size": 8, **dp})
    )


def _ema_step(res: Any, trainer: DPTrainer) -> None:
    trainer.stateful["ema"].update(trainer.model)


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


def _final(url: str, cfg: JobConfig) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The newest version's model, scheduler state and EMA state."""
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    tr = build_trainer(cfg, KEY, builder())
    state = decode(latest, tr.state_dict())
    tr.close()
    assert state["scheduler"] is not None
    return model_state(latest), state["scheduler"]["state"], state["stateful"]["ema"]["state"]


def test_dataset_path_equals_tensor_path_bit_for_bit() -> None:
    cfg = job_config("mlp", bands=4, steps=5).dp
    runs = []
    for wrap, via_loader in ((False, False), (True, False), (True, True)):
        parts = mlp.build(job_config("mlp", bands=4, steps=5))
        x, y = parts.dataset  # type: ignore[misc]
        data: Any = Pairs(x, y) if wrap else (x, y)
        tr = DPTrainer(parts.model, parts.optimizer, parts.loss_fn, data, cfg, KEY)
        if via_loader:
            for batch in tr.loader():
                tr.train_step(batch)
        else:
            while not tr.done:
                tr.train_step()
        runs.append(tr.model.state_dict())
        tr.close()
    for other in runs[1:]:
        assert all(torch.equal(runs[0][k], other[k]) for k in runs[0])


def test_a_batch_of_another_step_is_refused() -> None:
    tr = build_trainer(job_config("mlp", bands=2, steps=4), KEY)
    batch = next(iter(tr.loader()))
    tr.train_step(batch)
    with pytest.raises(ValueError, match=r"batch of step 0, the trainer is at step 1"):
        tr.train_step(batch)
    tr.close()


def test_dataset_size_comes_from_len_and_a_disagreeing_config_is_refused() -> None:
    parts = mlp.build(job_config("mlp"))
    x, y = parts.dataset  # type: ignore[misc]
    cfg = DPConfig(steps=2, batch_size=8, dataset_size=500, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=r"dataset_size=500 .* len\(dataset\)=512"):
        DPTrainer(parts.model, parts.optimizer, parts.loss_fn, Pairs(x, y), cfg, KEY)


def test_scheduler_and_stateful_resume_bit_for_bit(tmp_path: Path) -> None:
    """StepLR, an EMA, a Dataset and a physical batch of 8: stopped at step 10 and
    resumed, the job ends as the uninterrupted one (model, scheduler, EMA)."""
    cfg = _config()
    gold, run = str(tmp_path / "gold.zarr"), str(tmp_path / "run.zarr")
    run_job(
        cfg,
        gold,
        parts=builder(),
        on_step=_ema_step,
        options=JobOptions(key_file=str(tmp_path / "k")),
    )
    first = run_job(
        cfg,
        run,
        parts=builder(),
        on_step=_ema_step,
        stop_after=10,
        options=JobOptions(key_file=str(tmp_path / "k")),
    )
    assert first.steps_done == 10
    again = run_job(
        cfg,
        run,
        parts=builder(),
        on_step=_ema_step,
        options=JobOptions(key_file=str(tmp_path / "k")),
    )
    assert again.resumed_from == 10
    (ma, sa, ea), (mb, sb, eb) = _final(gold, cfg), _final(run, cfg)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert sa == sb and sa["last_epoch"] == 16
    assert ea["count"] == eb["count"] == 16 and ea["decay"] == (0.9,)
    assert all(torch.equal(ea["shadow"][k], eb["shadow"][k]) for k in ea["shadow"])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A store of the user job stopped at step 5, and its key file."""
    root = tmp_path_factory.mktemp("stopped")
    url, key = str(root / "s.zarr"), str(root / "k")
    run_job(
        _config(),
        url,
        parts=builder(),
        on_step=_ema_step,
        stop_after=5,
        options=JobOptions(key_file=key),
    )
    return url, key


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ({"momentum": 0.5}, r"optimizer.param_groups\[0\].momentum: stored 0.9, now 0.5"),
        ({"gamma": 0.25}, r"scheduler.state.gamma: stored 0.5, now 0.25"),
        ({"shift": 1.0}, r"dataset.digest: stored '[0-9a-f]{8}"),
    ],
    ids=["optimizer", "scheduler", "dataset"],
)
def test_resume_with_other_real_objects_is_refused(
    stopped: tuple[str, str], change: dict[str, float], difference: str
) -> None:
    url, key = stopped
    before = _tree(Path(url))
    with pytest.raises(ConfigMismatchError, match=difference) as info:
        run_job(
            _config(),
            url,
            parts=builder(**change),
            on_step=_ema_step,
            options=JobOptions(key_file=key),
        )
    assert len(info.value.differences) == 1
    assert _tree(Path(url)) == before  # refused before the first write


def test_resume_with_another_physical_batch_is_refused(stopped: tuple[str, str]) -> None:
    url, key = stopped
    before = _tree(Path(url))
    with pytest.raises(ConfigMismatchError, match=r"dp.physical_batch_size: stored 8, now 4"):
        run_job(
            _config(physical_batch_size=4), url, parts=builder(), options=JobOptions(key_file=key)
        )
    assert _tree(Path(url)) == before


def test_resume_with_another_noise_rng_is_refused(stopped: tuple[str, str]) -> None:
    url, key = stopped
    with pytest.raises(ConfigMismatchError, match=r"dp.noise_rng: stored 'default', now 'secure'"):
        run_job(_config(noise_rng="secure"), url, parts=builder(), options=JobOptions(key_file=key))
    with pytest.raises(GeneratorMismatchError, match="noise_rng=secure"):
        from cocoon_ckpt.dp.generator import check_generator_backend

        check_generator_backend(generator_backend(), rng=NoiseRng.SECURE)


def test_fingerprint_covers_the_real_objects() -> None:
    cfg = _config()
    tr = build_trainer(cfg, KEY, builder())
    other = build_trainer(cfg, KEY, builder(momentum=0.5))
    record, shapes = cfg.to_record(), {"w": [1]}
    assert cfgmod.fingerprint(record, shapes, dict(tr.identity)) != cfgmod.fingerprint(
        record, shapes, dict(other.identity)
    )
    # a default config's fingerprint is the one stores written before these fields had
    plain = job_config("mlp").to_record()
    old = {
        **plain,
        "dp": {
            k: v for k, v in plain["dp"].items() if k not in ("physical_batch_size", "noise_rng")
        },
    }
    assert cfgmod.fingerprint(plain, shapes) == cfgmod.fingerprint(old, shapes)
    assert cfgmod.fingerprint(cfg.to_record(), shapes) != cfgmod.fingerprint(plain, shapes)
    assert tr.identity["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert tr.identity["dataset"]["size"] == 512
    tr.close()
    other.close()


def test_an_optimizer_the_config_does_not_describe_is_refused() -> None:
    cfg = dataclasses.replace(_config(), lr=0.05)

    def adam(config: JobConfig) -> JobParts:
        parts = mlp.build(config)
        opt = torch.optim.Adam(parts.model.parameters(), lr=0.001)
        return dataclasses.replace(parts, optimizer=opt)

    with pytest.raises(
        ConfigError,
        match=r"Adam with lr=0.001, but JobConfig says "
        r"optimizer='sgd', lr=0.05.*--optimizer adam --lr 0.001",
    ):
        build_trainer(cfg, KEY, adam)
    build_trainer(dataclasses.replace(cfg, optimizer="adam", lr=0.001), KEY, adam).close()


def test_physical_batch_is_a_checked_field_and_close_to_the_whole_batch() -> None:
    with pytest.raises(ValueError, match=r"DPConfig.physical_batch_size=0"):
        DPConfig(
            steps=2, batch_size=8, dataset_size=64, noise_multiplier=1.0, physical_batch_size=0
        )
    whole = build_trainer(job_config("mlp", bands=2, steps=4), KEY)
    cfg = job_config("mlp", bands=2, steps=4)
    chunked = build_trainer(
        dataclasses.replace(cfg, dp=dataclasses.replace(cfg.dp, physical_batch_size=3)), KEY
    )
    idx = torch.arange(40)
    a, _ = whole.clipped_sum(idx)
    b, _ = chunked.clipped_sum(idx)
    assert torch.allclose(a, b, atol=1e-5)
    whole.close()
    chunked.close()


def test_lr_schedule_read_ahead_and_an_uncopyable_scheduler_refused() -> None:
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert lr_schedule_ahead(opt, sched, [p], 5) == (0.4, 0.4, 0.2, 0.2, 0.1)
    assert opt.param_groups[0]["lr"] == 0.4 and sched.last_epoch == 0  # untouched

    class Uncopyable(torch.optim.lr_scheduler.StepLR):
        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise TypeError("holds a lock")

    with pytest.raises(ConfigError, match="cannot be copied.*EmbeddingConfig.lr_schedule"):
        lr_schedule_ahead(opt, Uncopyable(opt, step_size=2), [p], 5)


def test_part_state_round_trips_exactly() -> None:
    arrays: dict[str, np.ndarray] = {}
    state: dict[Any, Any] = {
        "t": torch.arange(3.0),
        1: (0.5, None, "x"),
        "n": np.ones(2),
        "l": [True, 2],
    }
    rec = encode_part_state(state, "stateful/a", arrays)
    back = decode_part_state(rec, arrays.__getitem__)
    assert torch.equal(back["t"], state["t"]) and back[1] == (0.5, None, "x")
    assert np.array_equal(back["n"], state["n"]) and back["l"] == [True, 2]
    with pytest.raises(TypeError, match=r"stateful/a\['f'\] is a function"):
        encode_part_state({"f": lambda: 0}, "stateful/a", {})


def test_defaults_and_choices() -> None:
    assert DPConfig(steps=2, batch_size=8, dataset_size=64, noise_multiplier=1.0).mechanism is (
        MechanismKind.OPTIMIZED
    )
    assert NOISE_RNGS == tuple(r.value for r in NoiseRng)
    torch_names = {
        n.lower()
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    assert torch_names <= set(OPTIMIZERS)
