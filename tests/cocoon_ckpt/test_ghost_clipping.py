"""Ghost clipping (`DPConfig.clipping="ghost"`) against the vmap path: the same clipped sum
to float rounding over layer mixes, chunk sizes and dtypes; the same bits twice; a job
stopped and resumed ends as the uninterrupted ghost job; what it cannot serve is refused
by name."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cocoon_ckpt import ConfigMismatchError, run_job
from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.errors import ConfigError, UnsupportedModelError
from cocoon_ckpt.format.fingerprint import fingerprint
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train import ghost
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.grads import PerSampleGrads
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import Store

from . import real_job
from . import test_real_job_kill as kill
from .conftest import job_config

VOCAB, CLASSES = 13, 3


class Scale(nn.Module):
    """A layer ghost norms do not cover: its parameter takes per-sample gradients."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Mix(nn.Module):
    """Input (ids or features, with or without a sequence dim), a stack of layers, a head;
    the head's output is averaged over the sequence."""

    def __init__(self, embed: bool, width: int, layers: list[tuple[str, int, bool]]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=0) if embed else None
        body: list[nn.Module] = []
        d = width
        for kind, out, flag in layers:
            if kind == "linear":
                body += [nn.Linear(d, out, bias=flag), nn.Tanh()]
                d = out
            elif kind == "layernorm":
                body.append(nn.LayerNorm(d, elementwise_affine=True, bias=flag))
            else:
                body.append(Scale(d))
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        out = self.head(self.body(h))
        return out.mean(1) if out.dim() == 3 else out


def _case(
    embed: bool, seq: int | None, width: int, layers: list[Any], n: int, dtype: torch.dtype
) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(len(layers) * 31 + width)
    model = Mix(embed, width, layers).to(dtype)
    shape = (n,) if seq is None else (n, seq)
    g = torch.Generator().manual_seed(n)
    if embed:
        x = torch.randint(0, VOCAB, shape, generator=g)
    else:
        x = torch.randn(*shape, width, generator=g).to(dtype)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return model, [x, y]


def _both(model: nn.Module, batch: list[torch.Tensor], clip: float, chunk: int | None) -> Any:
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    loss = nn.functional.cross_entropy
    a = PerSampleGrads(model, loss, names).clipped_sum(batch, clip, chunk)
    b = GhostGrads(model, loss, names).clipped_sum(batch, clip, chunk)
    return a, b


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    scale = max(1.0, float(a.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


layer = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("layernorm"), st.just(0), st.booleans()),
    st.tuples(st.just("scale"), st.just(0), st.just(False)),
)


@settings(max_examples=40, deadline=None)
@given(
    embed=st.booleans(),
    seq=st.one_of(st.none(), st.integers(1, 6)),
    width=st.integers(1, 10),
    layers=st.lists(layer, max_size=4),
    n=st.integers(1, 9),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
    clip=st.sampled_from([1e-3, 0.3, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_ghost_sum_equals_the_vmap_sum(
    embed: bool,
    seq: int | None,
    width: int,
    layers: list[Any],
    n: int,
    chunk: int | None,
    clip: float,
    dtype: torch.dtype,
) -> None:
    model, batch = _case(embed, 1 if embed and seq is None else seq, width, layers, n, dtype)
    a, b = _both(model, batch, clip, chunk)
    assert a.summed.dtype == b.summed.dtype == dtype
    _close(a.summed, b.summed, dtype)
    assert abs(a.loss - b.loss) <= 1e-5 * max(1.0, abs(a.loss))
    assert a.nonfinite == b.nonfinite == []


@pytest.mark.parametrize("mode", ["ghost", "direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_linear_norms_equal_the_vmap_sum(
    monkeypatch: pytest.MonkeyPatch, mode: str, dtype: torch.dtype
) -> None:
    """Each of the two norms of a Linear over a sequence, forced on every layer."""
    monkeypatch.setattr(ghost, "linear_norm_mode", lambda *_: mode)
    model, batch = _case(True, 5, 6, [("linear", 7, True), ("layernorm", 0, True)], 8, dtype)
    a, b = _both(model, batch, 0.05, 3)
    _close(a.summed, b.summed, dtype)


def test_linear_norm_mode_takes_the_cheaper() -> None:
    assert ghost.linear_norm_mode(1, 768, 768) == "ghost"
    assert ghost.linear_norm_mode(32, 768, 3072) == "ghost"
    assert ghost.linear_norm_mode(512, 16, 16) == "direct"


def test_a_shared_block_and_the_same_bits_twice() -> None:
    """A Linear called twice per forward: its calls join along T."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.head = nn.Linear(4, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))

    torch.manual_seed(0)
    model = Twice().double()
    batch = [torch.randn(7, 4, dtype=torch.float64), torch.randint(0, CLASSES, (7,))]
    a, b = _both(model, batch, 0.1, 2)
    _close(a.summed, b.summed, torch.float64)
    again = _both(model, batch, 0.1, 2)[1]
    assert torch.equal(b.summed, again.summed) and b.loss == again.loss


def test_an_empty_batch_is_zeros() -> None:
    model, _ = _case(False, None, 3, [], 1, torch.float32)
    names = [k for k, _ in model.named_parameters()]
    r = GhostGrads(model, nn.functional.cross_entropy, names).clipped_sum(
        [torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64)], 1.0, 2
    )
    assert r.summed.shape == (sum(p.numel() for p in model.parameters()),)
    assert not r.summed.any()


def test_what_ghost_cannot_serve_is_refused_by_name() -> None:
    loss = nn.functional.cross_entropy

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 4)
            self.out = nn.Linear(4, VOCAB, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(x))

    with pytest.raises(
        UnsupportedModelError, match=r"emb.weight is tied to out.weight.*--clipping vmap"
    ):
        GhostGrads(Tied(), loss, ["emb.weight"])

    class Borrowed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.a(x), self.a.weight)

    m = Borrowed()
    with pytest.raises(UnsupportedModelError, match=r"a.weight \(in linear\) is used outside"):
        GhostGrads(m, loss, ["a.weight", "a.bias"]).clipped_sum(
            [torch.randn(3, 4), torch.randint(0, 4, (3,))], 1.0
        )

    class Transposed(Borrowed):  # through a property that carries the gradient
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.a.weight.shape == (4, 4)  # metadata: no gradient, not refused
            return self.a(x) @ self.a.weight.T

    with pytest.raises(UnsupportedModelError, match=r"a.weight \(in T\) is used outside"):
        GhostGrads(Transposed(), loss, ["a.weight", "a.bias"]).clipped_sum(
            [torch.randn(3, 4), torch.randint(0, 4, (3,))], 1.0
        )

    with pytest.raises(UnsupportedModelError, match=r"embedding 0 has max_norm set"):
        GhostGrads(nn.Sequential(nn.Embedding(5, 2, max_norm=1.0)), loss, ["0.weight"])
    emb = nn.Sequential(nn.Embedding(5, 2))
    emb.add_module("e", nn.Embedding(5, 2, scale_grad_by_freq=True))
    with pytest.raises(UnsupportedModelError, match="e has scale_grad_by_freq"):
        GhostGrads(emb, loss, ["0.weight", "e.weight"])
    with pytest.raises(UnsupportedModelError, match="embedding noise tables"):
        GhostGrads(
            nn.Sequential(nn.Embedding(5, 2)),
            loss,
            [],
            tables=[TableSpec(param="0.weight", data_index=0, column=0)],
        )

    class Positions(nn.Module):  # a table read without the batch: per-example parts unknown
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x + self.pos(torch.arange(6))).mean(1)

    grads = GhostGrads(Positions(), loss, ["pos.weight", "head.weight", "head.bias"])
    for _ in range(2):  # and nothing of the refused chunk is left for the next
        with pytest.raises(UnsupportedModelError, match=r"pos \(Embedding\) was called on \[6\]"):
            grads.clipped_sum([torch.randn(3, 6, 4), torch.randint(0, 3, (3,))], 1.0)

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).relu_()

    with pytest.raises(UnsupportedModelError, match=r"output of a \(Linear\) was changed in place"):
        GhostGrads(InPlace(), loss, ["a.weight", "a.bias"]).clipped_sum(
            [torch.randn(3, 4), torch.randint(0, 4, (3,))], 1.0
        )


def test_clipping_is_a_checked_fingerprinted_field() -> None:
    dp = job_config().dp
    with pytest.raises(ConfigError, match=r"DPConfig.clipping.*be one of \('vmap', 'ghost'\)"):
        dataclasses.replace(dp, clipping="opacus")
    vmap_rec = JobConfig(job="example:mlp", dp=dp).to_record()
    ghost_rec = JobConfig(
        job="example:mlp", dp=dataclasses.replace(dp, clipping="ghost")
    ).to_record()
    older = json.loads(json.dumps(vmap_rec))
    del older["dp"]["clipping"]  # a store written before the field existed
    shapes = {"w": [2]}
    assert fingerprint(vmap_rec, shapes) == fingerprint(older, shapes)
    assert fingerprint(ghost_rec, shapes) != fingerprint(vmap_rec, shapes)


def tiny_lm(config: JobConfig) -> JobParts:
    """A small transformer-shaped job: token embedding, LayerNorms, an MLP block with a
    residual, a per-feature gain (per-sample path), a head averaged over 6 tokens."""
    torch.manual_seed(config.dp.seed)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.ln1 = nn.LayerNorm(8)
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)
            self.gain = Scale(8)
            self.ln2 = nn.LayerNorm(8)
            self.head = nn.Linear(8, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            h = h + self.down(nn.functional.gelu(self.up(self.ln1(h))))
            return self.head(self.ln2(self.gain(h))).mean(1)

    model = LM()
    g = torch.Generator().manual_seed(config.dp.seed + 1)
    x = torch.randint(0, VOCAB, (config.dp.dataset_size, 6), generator=g)
    y = (x[:, 0] % CLASSES).long()
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    return JobParts(model=model, optimizer=opt, loss_fn=nn.functional.cross_entropy, data=(x, y))


def _ghost_config() -> JobConfig:
    cfg = job_config("mlp", bands=4, steps=12, optimizer="adam", lr=0.01)
    dp = dataclasses.replace(cfg.dp, physical_batch_size=8, clipping="ghost")
    return dataclasses.replace(cfg, dp=dp)


def test_a_ghost_job_stopped_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    cfg, key = _ghost_config(), str(tmp_path / "k")
    gold, run = str(tmp_path / "gold.zarr"), str(tmp_path / "run.zarr")
    run_job(cfg, gold, parts=tiny_lm, options=JobOptions(key_file=key))
    for stop in (3, 7):
        assert (
            run_job(
                cfg, run, parts=tiny_lm, stop_after=stop, options=JobOptions(key_file=key)
            ).steps_done
            == stop
        )
    assert run_job(cfg, run, parts=tiny_lm, options=JobOptions(key_file=key)).resumed_from == 5
    a, b = Store.open(gold, create=False).latest(), Store.open(run, create=False).latest()
    assert a is not None and b is not None

    ma, mb = model_state(a), model_state(b)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    # the vmap job of the same config differs (other GEMMs), and resuming under it is refused
    with pytest.raises(ConfigMismatchError, match=r"dp.clipping: stored 'ghost', now 'vmap'"):
        vmap_cfg = dataclasses.replace(cfg, dp=dataclasses.replace(cfg.dp, clipping="vmap"))
        run_job(vmap_cfg, run, parts=tiny_lm, options=JobOptions(key_file=key))


@pytest.mark.slow
def test_a_ghost_job_sigkilled_after_a_commit_resumes_bit_identical(tmp_path: Path) -> None:
    """The user's real job (DataLoader workers, StepLR, an EMA) under --clipping ghost in
    a real `cocoon-ckpt train` process, SIGKILLed after its first commit and rerun, ends
    bit for bit as the uninterrupted ghost run (one key file)."""
    cfg = dataclasses.replace(
        kill._config(), dp=dataclasses.replace(kill._config().dp, clipping="ghost")
    )
    key, gold, url = tmp_path / "noise.key", str(tmp_path / "gold.zarr"), str(tmp_path / "r.zarr")
    run_job(cfg, gold, parts=real_job.build, options=JobOptions(key_file=str(key)))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(cfg.to_record()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(kill.ROOT), *sys.path])}
    cmd = [
        *(sys.executable, "-m", "cocoon_ckpt", "train", "--config", str(job)),
        *("--store", url, "--key-file", str(key), "--no-progress"),
    ]
    with (tmp_path / "first.err").open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=kill.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    kill._wait_for_commit(proc, url, "ghost job")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = Store.open(url, create=False).latest()
    assert proc.returncode == -signal.SIGKILL and killed_at is not None
    assert killed_at.step < kill.STEPS, "the job finished before the kill: nothing was resumed"
    with (tmp_path / "second.err").open("wb") as err:
        done = subprocess.run(cmd, cwd=kill.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    assert done.returncode == 0, (tmp_path / "second.err").read_text()
    kill._assert_same_final(gold, url, f"ghost job killed at step {killed_at.step}")


def test_cli_clipping_flag_runs_a_ghost_job(tmp_path: Path) -> None:
    """`cocoon-ckpt train --clipping ghost` records it; the same command rerun with
    --clipping vmap is refused by the state of the store (exit 1), writing nothing."""
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    base = [sys.executable, "-m", "cocoon_ckpt", "train", "--store", url, "--example", "mlp"]
    base += ["--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--key-file", key]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([*base, "--clipping", "ghost"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    refused = subprocess.run([*base, "--clipping", "vmap"], capture_output=True, text=True, env=env)
    assert refused.returncode == 1, refused.stderr
    assert "dp.clipping" in refused.stderr
    after = Store.open(url, create=False).latest()
    assert after is not None and after.version == latest.version


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ghost_on_cuda_equals_vmap_and_repeats_its_bits(dtype: torch.dtype) -> None:
    model, batch = _case(
        True, 7, 16, [("linear", 32, True), ("layernorm", 0, True), ("scale", 0, False)], 12, dtype
    )
    model = model.cuda()
    batch = [t.cuda() for t in batch]
    a, b = _both(model, batch, 0.1, 5)
    assert b.summed.device.type == "cuda"
    _close(a.summed, b.summed, dtype)
    again = _both(model, batch, 0.1, 5)[1]
    assert torch.equal(b.summed, again.summed)


def test_a_layer_without_ghost_norms_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    model, batch = _case(False, 3, 4, [("scale", 0, False), ("linear", 5, True)], 6, torch.float64)
    names = [k for k, _ in model.named_parameters()]
    with caplog.at_level("INFO", logger="cocoon_ckpt.train.ghost"):
        grads = GhostGrads(model, nn.functional.cross_entropy, names)
        grads.clipped_sum(batch, 0.1, 4)
        grads.clipped_sum(batch, 0.1, 4)
    said = [r.getMessage() for r in caplog.records if "per-sample gradients" in r.getMessage()]
    assert said == [
        "ghost clipping: body.0 (Scale) take per-sample gradients of their own parameters "
        "(ghost norms cover nn.Linear, nn.LayerNorm and nn.Embedding)"
    ]
