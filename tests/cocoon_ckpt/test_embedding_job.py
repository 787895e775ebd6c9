"""Embedding noise inside the trainer and the store: per-row gradients equal the dense
per-sample path; a coalesced job ends where the dense mechanism ends (I5); crash and
resume are bit-exact with the CSC stored once; what must be refused is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cocoon_ckpt import DPConfig, DPTrainer, JobConfig, export_model, run_job
from cocoon_ckpt.embedding import EmbeddingConfig, TableMode
from cocoon_ckpt.errors import ConfigMismatchError
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.runner import build_trainer
from state import Store, StoreError

KEY = bytes(range(32))


def _config(mode: str = "coalesced", bands: int = 4, steps: int = 14, **emb: Any) -> JobConfig:
    return JobConfig(
        job="example:dlrm",
        dp=DPConfig(
            steps=steps, batch_size=12, dataset_size=360, noise_multiplier=1.0, bands=bands
        ),
        options={"tables": [90, 40, 7], "dim": 3, "dense": 4, "dtype": "float64"},
        checkpoint_every=4,
        lr=0.5,
        embedding=EmbeddingConfig(
            mode=TableMode(mode),
            threat_model=emb.pop("threat_model", "final_model"),
            hot_threshold=emb.pop("hot_threshold", 2),
            **emb,
        ),
    )


def _train(config: JobConfig) -> tuple[DPTrainer, list[dict[str, torch.Tensor]]]:
    tr = build_trainer(config, KEY)
    assert tr.embedding is not None
    tr.embedding.prepare()
    states = []
    while not tr.done:
        tr.train_step()
        states.append({k: v.clone() for k, v in tr.model.state_dict().items()})
    return tr, states


def test_row_gradients_equal_the_dense_per_sample_path() -> None:
    """Clipping sees each example's exact norm: the per-row path's clipped sum equals
    vmap over the whole tables, scattered."""
    sparse_cfg = _config("dense")
    dense_cfg = dataclasses.replace(sparse_cfg, embedding=None)
    sp, de = build_trainer(sparse_cfg, KEY), build_trainer(dense_cfg, KEY)
    idx = torch.from_numpy(sp.sampler.batch(3))
    got_dense, loss_a = sp.clipped_sum(idx)
    want, loss_b = de.clipped_sum(idx)
    assert loss_a == pytest.approx(loss_b, rel=1e-12)
    params = dict(de.model.named_parameters())
    offsets, off = {}, 0
    for name in de.param_names:
        offsets[name] = (off, off + params[name].numel())
        off += params[name].numel()
    for name, (a, z) in offsets.items():
        if name in sp.param_names:
            i = sp.param_names.index(name)
            lo = sum(sp._noisy.sizes[:i])
            torch.testing.assert_close(
                got_dense[lo : lo + z - a], want[a:z], rtol=1e-12, atol=1e-14
            )
    assert sp.embedding is not None
    for eng, (rows, vals) in zip(sp.embedding.engines, sp._table_grads, strict=True):
        a, z = offsets[eng.spec.param]
        full = torch.zeros(eng.rows, eng.dim, dtype=torch.float64).index_add_(0, rows, vals)
        torch.testing.assert_close(full.ravel(), want[a:z], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("threshold", [0, 2, None])
def test_coalesced_job_ends_where_the_dense_mechanism_ends(threshold: int | None) -> None:
    """I5 through the whole trainer (float64): every step's dense parameters, which
    depend on every row read so far, and the final tables after their tails."""
    _, ref = _train(_config("dense"))
    tr, got = _train(_config("coalesced", hot_threshold=threshold))
    assert tr.embedding is not None
    assert all(e.plan.mode is TableMode.COALESCED for e in tr.embedding.engines)
    for t, (a, b) in enumerate(zip(ref, got, strict=True)):
        for k in a:
            if t == len(ref) - 1 or not k.startswith("tables"):
                torch.testing.assert_close(b[k], a[k], rtol=1e-12, atol=1e-12, msg=f"{k} @ {t}")


@pytest.mark.parametrize(("mode", "bands"), [("coalesced", 4), ("lazy", 1), ("dense", 4)])
def test_stop_and_resume_is_bit_exact_and_the_csc_is_written_once(
    tmp_path: Path, mode: str, bands: int
) -> None:
    cfg = _config(mode, bands=bands)
    key = str(tmp_path / "k")
    run_job(cfg, str(tmp_path / "gold"), options=JobOptions(key_file=key))
    for stop in (1, 6, 9):  # before the first checkpoint, mid-way, just after one
        run_job(cfg, str(tmp_path / "run"), stop_after=stop, options=JobOptions(key_file=key))
    run_job(cfg, str(tmp_path / "run"), options=JobOptions(key_file=key))
    gold = model_state(Store.open(str(tmp_path / "gold"), create=False).latest())  # type: ignore[arg-type]
    store = Store.open(str(tmp_path / "run"), create=False)
    got = model_state(store.latest())  # type: ignore[arg-type]
    assert all(torch.equal(gold[k], got[k]) for k in gold)
    paths = {}
    for v in store.versions():
        man = store.manifest(v)
        assert man.records["threat_model"] == "final_model"
        emb = man.records["embedding"]
        assert [t["plan"]["mode"] for t in emb["tables"]] == [mode] * 3
        for name, meta in man.arrays.items():
            if name.startswith("emb/") and "/ring/" not in name:
                paths.setdefault(name, set()).add(meta.path)
    # the CSC (coalesced) and noise order: one shared copy, referenced by every version
    assert paths and all(
        len(p) == 1 and next(iter(p)).startswith("shared/") for p in paths.values()
    )
    assert any("/csc/" in n for n in paths) == (mode == "coalesced")


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="final_model"):
        EmbeddingConfig(mode=TableMode.COALESCED)
    adam = dataclasses.replace(_config(), optimizer="adam")
    with pytest.raises(ValueError, match="plain SGD.*Adam"):
        build_trainer(adam, KEY)
    with pytest.raises(ValueError, match="lazy.*bands=1"):
        build_trainer(_config("lazy", bands=4), KEY)
    with pytest.raises(ValueError, match="lr_schedule has 3 rates"):
        build_trainer(_config(lr_schedule=(0.1, 0.2, 0.3)), KEY)
    tr = build_trainer(_config(lr_schedule=tuple([0.5] * 13 + [0.25])), KEY)
    with pytest.raises(ValueError, match="step 0.*learning rate 0.4.*precomputed for 0.5"):
        for g in tr.optimizer.param_groups:
            g["lr"] = 0.4
        tr.train_step()


def test_lr_schedule_is_exact(tmp_path: Path) -> None:
    sched = tuple(float(x) for x in np.linspace(0.6, 0.1, 14))
    out = {}
    for mode in ("dense", "coalesced"):
        tr = build_trainer(_config(mode, lr_schedule=sched), KEY)
        assert tr.embedding is not None
        tr.embedding.prepare()
        while not tr.done:
            for g in tr.optimizer.param_groups:
                g["lr"] = sched[tr.step_index]
            tr.train_step()
        out[mode] = tr.model.state_dict()
    for k in out["dense"]:
        torch.testing.assert_close(out["coalesced"][k], out["dense"][k], rtol=1e-12, atol=1e-12)


def test_unfinished_final_model_job_is_not_exported(tmp_path: Path) -> None:
    store, key = str(tmp_path / "s"), str(tmp_path / "k")
    run_job(_config(), store, stop_after=5, options=JobOptions(key_file=key))
    with pytest.raises(StoreError, match="final_model.*must not be released"):
        export_model(store, str(tmp_path / "m.pt"), allow_incomplete=True, key_file=key)
    run_job(_config(), store, options=JobOptions(key_file=key))
    # finished, but without the key file its step count is not authenticated
    with pytest.raises(StoreError, match="not authenticated by a key file kept apart"):
        export_model(store, str(tmp_path / "m.pt"))
    report = export_model(store, str(tmp_path / "m.pt"), key_file=key)
    assert report["threat_model"] == "final_model" and report["source"]["authenticated"]


def test_resume_with_another_threat_model_or_mode_is_refused(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    run_job(_config(), store, stop_after=5)
    for other in (_config("dense"), _config(threat_model="intermediate_iterates", mode="dense")):
        with pytest.raises(ConfigMismatchError, match="embedding"):
            run_job(other, store)
