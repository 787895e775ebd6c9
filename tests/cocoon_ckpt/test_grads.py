from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.errors import UnsupportedModelError
from cocoon_ckpt.examples.dlrm import DLRM, make_data
from cocoon_ckpt.train.grads import PerSampleGrads

CLIP = 0.5
CHUNKS = [1, 3, 7, None]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The chunks' kernels are small: on a loaded shared box, OpenMP threads
    oversubscribe the cores and a chunk of 8 runs ten times slower than on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(nn.Module):
    """An MLP with a frozen first layer and a buffer, as a fine-tuned model has."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.stem.requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-1, 1, 12))
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.stem(x) + self.shift)
        return out


def _dense(n: int = 40) -> tuple[Net, PerSampleGrads, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
    return model, PerSampleGrads(model, nn.functional.cross_entropy, names), [x, y]


def _reference(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: list[torch.Tensor],
    names: list[str],
) -> tuple[torch.Tensor, float]:
    """One example at a time with torch.autograd: gradient, clip, sum (float64 sum)."""
    params = dict(model.named_parameters())
    total = torch.zeros(sum(params[k].numel() for k in names), dtype=torch.float64)
    losses = []
    for i in range(int(batch[0].shape[0])):
        inputs = [d[i : i + 1] for d in batch[:-1]]
        loss = loss_fn(model(*inputs), batch[-1][i : i + 1])
        grads = torch.autograd.grad(loss, [params[k] for k in names])
        flat = torch.cat([g.flatten() for g in grads]).double()
        total += flat * min(1.0, CLIP / (float(flat.norm()) + 1e-6))
        losses.append(float(loss.detach()))
    return total, sum(losses) / len(losses)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_sum_matches_a_per_example_autograd_reference(chunk: int | None) -> None:
    model, ps, batch = _dense()
    got = ps.clipped_sum(batch, CLIP, chunk)
    ref, ref_loss = _reference(model, nn.functional.cross_entropy, batch, ps.param_names)
    assert got.summed.shape == (ps.dim,) and got.summed.dtype == torch.float32
    assert torch.allclose(got.summed.double(), ref, atol=1e-5)
    assert got.loss == pytest.approx(ref_loss, rel=1e-5)
    assert got.table_grads == []


def test_chunked_sums_agree_and_each_chunk_size_is_deterministic() -> None:
    """Bit-identical across chunk sizes is impossible (vmap's per-sample gradients move
    in the last bits with the rows it takes at once), so: equal to tolerance, the same
    bits on every call with one chunk size, and the whole batch the same bits as None."""
    _, ps, batch = _dense()
    whole = ps.clipped_sum(batch, CLIP, None)
    for chunk in (3, 7, 40, 41, 1000):
        a, b = ps.clipped_sum(batch, CLIP, chunk), ps.clipped_sum(batch, CLIP, chunk)
        assert torch.equal(a.summed, b.summed) and a.loss == b.loss
        assert torch.allclose(a.summed, whole.summed, atol=1e-6)
        if chunk >= 40:
            assert torch.equal(a.summed, whole.summed) and a.loss == whole.loss


def test_an_empty_batch_sums_to_zero() -> None:
    _, ps, batch = _dense()
    got = ps.clipped_sum([d[:0] for d in batch], CLIP, 3)
    assert torch.equal(got.summed, torch.zeros(ps.dim)) and got.loss != got.loss


def _dlrm(n: int = 30) -> tuple[DLRM, list[TableSpec], list[torch.Tensor]]:
    torch.manual_seed(1)
    model = DLRM(5, [40, 25], 4)
    specs = [TableSpec(param=f"tables.{i}.weight", data_index=1, column=i) for i in range(2)]
    return model, specs, list(make_data(n, 5, [40, 25], 1.1, seed=2))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sparse_tables_match_the_dense_reference(chunk: int | None) -> None:
    """Per-row table gradients, chunked, equal the dense autograd gradient of the whole
    model (tables included) clipped per example, scattered back to rows."""
    model, specs, batch = _dlrm()
    loss_fn = nn.functional.binary_cross_entropy_with_logits
    tables = [s.param for s in specs]
    dense = [k for k, _ in model.named_parameters() if k not in tables]
    ps = PerSampleGrads(model, loss_fn, dense, tables=specs)
    got = ps.clipped_sum(batch, CLIP, chunk)
    ref, ref_loss = _reference(model, loss_fn, batch, dense + tables)
    assert torch.allclose(got.summed.double(), ref[: ps.dim], atol=1e-5)
    offset = ps.dim
    params = dict(model.named_parameters())
    for name, (rows, sums) in zip(tables, got.table_grads, strict=True):
        full = torch.zeros_like(params[name], dtype=torch.float64)
        full[rows] = sums.double()
        size = params[name].numel()
        assert torch.allclose(full.flatten(), ref[offset : offset + size], atol=1e-5)
        offset += size
    assert got.loss == pytest.approx(ref_loss, rel=1e-5)
    empty = ps.clipped_sum([d[:0] for d in batch], CLIP, chunk)
    assert [tuple(s.shape) for _, s in empty.table_grads] == [(0, 4), (0, 4)]


class Counting(PerSampleGrads):
    """Records the rows of every per-sample gradient tensor vmap hands back."""

    rows: list[int]

    def per_sample(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        chunk: list[torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        out = super().per_sample(params, buffers, chunk)
        self.rows += [int(g.shape[0]) for g in out[0].values()]
        return out


def test_no_per_sample_tensor_holds_more_than_a_chunk() -> None:
    model, _, batch = _dense(n=50)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    ps = Counting(model, nn.functional.cross_entropy, names)
    for chunk, calls in ((7, 8), (16, 4), (None, 1)):
        ps.rows = []
        ps.clipped_sum(batch, CLIP, chunk)
        assert max(ps.rows) == (chunk or 50) and len(ps.rows) == calls * len(names)


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK),
    reason="needs Linux's resettable peak RSS (/proc/self/clear_refs)",
)
def test_peak_memory_follows_the_physical_batch() -> None:
    """Logical batch 256 of a 66k-parameter layer: the whole batch's per-sample
    gradients are 67 MB, a chunk of 8's are 2 MB."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    ps = PerSampleGrads(model, nn.functional.cross_entropy, ["weight", "bias"])
    batch = [torch.randn(256, 256), torch.randint(0, 256, (256,))]
    ps.clipped_sum(batch, CLIP, 8)  # warm: vmap's first call allocates its caches
    grown = {}
    for chunk in (8, None):
        before = _rss_kib()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        ps.clipped_sum(batch, CLIP, chunk)
        grown[chunk] = _peak_kib() - before
    full_mib = 256 * ps.dim * 4 / 2**20
    assert grown[None] > 0.8 * full_mib * 1024, grown
    assert grown[8] < grown[None] / 8, grown


class InPlace(nn.Module):
    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))  # a running statistic: couples examples through state
        out: torch.Tensor = self.lin(x)
        return out


def test_models_torch_func_cannot_take_are_clear_errors() -> None:
    data = [torch.randn(8, 4), torch.randint(0, 2, (8,))]
    ps = PerSampleGrads(InPlace(), nn.functional.cross_entropy, ["lin.weight", "lin.bias"])
    with pytest.raises(
        UnsupportedModelError,
        match=r"torch.func could not take per-sample gradients of InPlace: .*in-place buffer "
        r"updates or batch-coupled layers have no per-sample path",
    ):
        ps.clipped_sum(data, CLIP, 3)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(UnsupportedModelError, match="BatchNorm1d.*GroupNorm"):
        PerSampleGrads(bn, nn.functional.cross_entropy, ["0.weight"])
    with pytest.raises(UnsupportedModelError, match="float32/float64"):
        PerSampleGrads(nn.Linear(4, 2).half(), nn.functional.cross_entropy, ["weight"])


def test_refusals_name_the_argument() -> None:
    model, ps, batch = _dense()
    with pytest.raises(ValueError, match="physical_batch_size=0 must be >= 1 or None"):
        ps.clipped_sum(batch, CLIP, 0)
    with pytest.raises(ValueError, match="disagree on the number of examples"):
        ps.clipped_sum([batch[0], batch[1][:5]], CLIP, None)
    with pytest.raises(ValueError, match=r"\['nope'\] are not parameters of Net"):
        PerSampleGrads(model, nn.functional.cross_entropy, ["nope"])
    with pytest.raises(ValueError, match="both embedding tables and dense parameters"):
        PerSampleGrads(
            model,
            nn.functional.cross_entropy,
            ["head.1.weight"],
            tables=[TableSpec(param="head.1.weight", data_index=0, column=0)],
        )
