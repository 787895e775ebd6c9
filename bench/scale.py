"""A GPT-2-shaped transformer at scale: a non-private step against our DP step with
per-sample gradients by vmap (`--clipping vmap`) and by ghost norms (`--clipping ghost`),
and Opacus' hooks and ghost clipping when opacus is importable; then where ghost clipping
overtakes vmap as the model grows.

The model: token and position embeddings, `depth` pre-LayerNorm blocks of causal
self-attention (written from nn.Linear, as GPT-2 is) and a 4x MLP with GELU, a final
LayerNorm and a classification head on the mean over the sequence. Every contender takes
the same model (same seed), the same batches (logical batch `--batch`, fixed size, so
every DP step takes the same number of examples) and the same physical chunks
(`--physical`). Ours is the whole DP step of `DPTrainer` (clipped sum, BandMF noise of
`--bands` bands, optimizer), SGD everywhere.

Each contender runs in its own subprocess, so its peak RSS (`ru_maxrss`, whole process:
model, optimizer, ring, activations, per-sample chunk) is its own; on CUDA the peak of
torch's allocator is printed too. Per contender: the median seconds per step over
`--steps` steps after `--warmup`, and its ratio to the non-private step of the same run.
Rows `vmap-clip` and `ghost-clip` take the clipped sum alone (no noise, no optimizer):
the clipping's own share of the step and of its memory. Under each table, where our DP
steps' time goes: the clipped sum, fresh noise, the GEMV over the ring, the ring write,
w = (z - h) / c_0, the noise added into the gradients, optimizer, accountant and the rest
(the metrics' norms, hooks), each timed by wrapping that method of the trainer's own
objects on the table's clock (the GEMV's tier thread counts on the CPU clock).
`--overlap` adds a table on the wall clock where every contender has 2 threads: the plain
step torch's 2 intra-op threads, ours with `overlap_noise` (w_t computed in a thread
while the gradients are taken; `-g1`: the gradients on one thread beside it). The crossover table repeats vmap
and ghost at depth 2 over widths (`--sweep`) and sequence lengths (`--sweep-seq`): the
per-sample gradients vmap forms grow with the parameters, ghost's norms with T^2.
"steps MiB" is the peak RSS during the timed steps above the RSS before them (after the
warm-up steps, whose one-time costs the whole-process peak includes).

A ring beyond host memory (`--host-budget`, `--far-dir`): our ghost DP step with the ring
all on the host at the smallest `--far-bands`, against the ring split over a host budget
and a far tier backed by a file in `--far-dir`, at each `--far-bands` (the largest need
not fit in RAM). Each ring is written whole before the timed steps (a job past step b-1;
a new far file's holes would read as zeros without touching the disk). The CPU clock
adds the far worker's CPU time; peak RSS is the trainer's, the worker's beside it.

    python bench/scale.py                      # 4 blocks, d 256, seq 32: < 2 min on 2 cores
    python bench/scale.py --85m                # 12 blocks, d 768, 12 heads (GPT-2 small)
    python bench/scale.py --85m --physical 8 --overlap-only  # 2 threads, wall clock
    python bench/scale.py --device cuda        # the same on a GPU
    python bench/scale.py --85m --bands-table 1 8 32 --host-budget 4GB --far-dir /var/tmp
                                               # the step against b in one table: plain
                                               # (before and after) and ghost at each b,
                                               # a ring over 4 GB on host 4 GB + far file
    python bench/scale.py --85m --far-only --host-budget 4GB --far-dir /var/tmp
                                               # b = 16 on the host vs host 4 GB + far file,
                                               # and b = 32 (10.6 GB of ring) on host + far
    /tmp/opvenv/bin/python bench/scale.py      # with opacus installed (a venv with
                                               # --system-site-packages and opacus)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

MIB = 1 << 20


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention from Linear layers, 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-shaped: embeddings, `depth` blocks, final LayerNorm, a classifier head."""

    def __init__(self, depth: int, d: int, heads: int, vocab: int, seq: int, classes: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # contiguous: Opacus' embedding norm views the ids
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        h = self.blocks(self.wte(ids) + self.wpe(pos))
        return self.head(self.ln(h)).mean(1)


def make(spec: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (seeded) and `dataset` examples of token ids and labels."""
    torch.manual_seed(0)
    model = GPT(
        spec["depth"], spec["d"], spec["heads"], spec["vocab"], spec["seq"], spec["classes"]
    )
    g = torch.Generator().manual_seed(1)
    n = spec["batch"] * 64
    x = torch.randint(0, spec["vocab"], (n, spec["seq"]), generator=g)
    y = torch.randint(0, spec["classes"], (n,), generator=g)
    return model, x, y


def child(spec: dict[str, Any]) -> None:
    """One contender in this fresh process: prints one JSON line."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model, x, y = make(spec)
    model = model.to(device)
    b, kind = spec["batch"], spec["kind"]
    loss_fn = nn.functional.cross_entropy
    batches = [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(64)]
    step = _step(kind, model, loss_fn, spec, batches, device)
    # CPU time of the process by default: on a shared machine a neighbour's load lengthens
    # wall time, not the work a step does (CUDA steps are timed on the wall clock)
    cpu = spec["clock"] == "cpu" and device.type != "cuda"
    clock = time.process_time if cpu else time.perf_counter
    far = _far_worker_pid(step)
    if cpu and far is not None:  # the far tier's GEMV runs in its worker: its CPU counts

        def clock() -> float:
            return time.process_time() + _cpu_s(far)

    times = []
    trainer = getattr(step, "trainer", None)
    parts = _instrument(trainer, clock) if trainer is not None and spec.get("breakdown") else None
    per_step: list[dict[str, float]] = []
    base, reset = 0, False
    for i in range(spec["warmup"] + spec["steps"]):
        if i == spec["warmup"]:  # the steady steps' own peak: after the first-use costs
            base = _status_kib("VmRSS")
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                reset = True
            except OSError:
                reset = False
        if device.type == "cuda":
            torch.cuda.synchronize()
        if spec.get("far_cold"):
            _drop_far_cache(step)
        if parts is not None:
            parts.clear()
        t = clock()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t)
        if parts is not None:
            per_step.append({**parts, "step": times[-1]})
    out = {
        "kind": kind,
        "params": sum(p.numel() for p in model.parameters()),
        "s": statistics.median(times[spec["warmup"] :]),
        "range": [min(times[spec["warmup"] :]), max(times[spec["warmup"] :])],
        "first": times[0],
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_mib": (_status_kib("VmHWM") - base) / 1024 if reset else float("nan"),
    }
    if device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
    if per_step:
        steady = per_step[spec["warmup"] :]
        out["parts"] = {k: statistics.median(p.get(k, 0.0) for p in steady) for k in steady[0]}
    if far is not None:  # the far tier's worker is a process of its own
        out["far_worker_mib"] = _status_kib("VmHWM", far) / 1024
        history = step.trainer.noise.state_rows
        out["plan"] = {p["tier"]: p["stop"] - p["start"] for p in history.placement()}
    if trainer is not None:
        trainer.close()  # the far tier's folder goes with it
    print(json.dumps(out))


#: The parts of our DP step `--breakdown` times, in the order they run: (label, object
#: path from the trainer, method). The noise step's own rest is "w = (z - h) / c_0".
PARTS = [
    ("clipped sum", "", "_clipped"),
    ("fresh noise z_t", "noise.fresh_noise", "fresh"),
    ("GEMV over the ring", "noise.history", "gemv"),
    ("ring write", "noise.history", "write"),
    ("noise step", "noise", "step"),
    ("(sum + w) / B into .grad", "_noisy", "set"),
    ("optimizer", "optimizer", "step"),
    ("accountant", "accountant", "step"),
]


def _instrument(trainer: Any, clock: Any) -> dict[str, float]:
    """Wrap the methods of PARTS on this trainer's own objects with `clock` timers; the
    returned dict gathers each part's seconds (clear it before a step). The wrappers
    only time: every call goes through with the same arguments."""
    acc: dict[str, float] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + clock() - t0

        setattr(obj, name, timed)

    for label, path, name in PARTS:
        obj = trainer
        for attr in filter(None, path.split(".")):
            obj = getattr(obj, attr)
        wrap(obj, name, label)
    return acc


def breakdown(rows: dict[str, dict[str, Any]], base: dict[str, Any] | None) -> None:
    """Where the time of each DP step goes (`--breakdown`): the median over the timed
    steps of each part, in seconds and as a multiple of the non-private step."""
    timed = {k: r for k, r in rows.items() if "parts" in r}
    if not timed:
        return
    labels = [label for label, _, _ in PARTS]
    print("\n  where the DP step goes (median s over the timed steps; x plain in brackets)")
    print(f"  {'part':<30}" + "".join(f" {k:>20}" for k in timed))
    plain = base["s"] if base else float("nan")

    def cell(v: float) -> str:
        return f"{v:9.3f} ({v / plain:5.2f}x)"

    def line(label: str, values: list[float]) -> None:
        print(f"  {label:<30}" + "".join(f" {cell(v):>20}" for v in values))

    for label in labels:
        vals = [r["parts"].get(label, 0.0) for r in timed.values()]
        if label == "noise step":
            sub = [
                r["parts"].get(label, 0.0) - sum(r["parts"].get(x, 0.0) for x in labels[1:4])
                for r in timed.values()
            ]
            line("  w = (z - h) / c_0, the rest", sub)
            line("noise step, in all", vals)
            continue
        line(("  " if label in labels[1:4] else "") + label, vals)
    # an overlapped noise step runs beside the clipped sum: the training thread waits
    # only for what is left of it, which "other" then holds
    rest = [
        r["parts"]["step"]
        - sum(
            r["parts"].get(x, 0.0)
            for x in [labels[0], *labels[4:]]
            if not (x == "noise step" and k.startswith("ghost-overlap"))
        )
        for k, r in timed.items()
    ]
    line("other (norms, hooks, waits)", rest)
    line("whole step", [r["parts"]["step"] for r in timed.values()])


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _drop_far_cache(step: Any) -> None:
    """Write the far file's dirty pages out and drop its pages from the page cache, so
    the next GEMV reads the far part from the disk (a ring beyond RAM, where the cache
    cannot hold it)."""
    history = getattr(getattr(getattr(step, "trainer", None), "noise", None), "history", None)
    for tier in getattr(history, "tiers", []):
        fd = getattr(tier, "_fd", None)
        if fd is not None:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _far_worker_pid(step: Any) -> int | None:
    """The far tier's worker process of our step's ring, if it has one."""
    history = getattr(getattr(getattr(step, "trainer", None), "noise", None), "history", None)
    for tier in getattr(history, "tiers", []):
        pid = getattr(tier, "worker_pid", None)
        if pid is not None:
            return int(pid)
    return None


def _status_kib(field: str, pid: int | str = "self") -> int:
    """A field of /proc/<pid>/status in KiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _step(
    kind: str,
    model: nn.Module,
    loss_fn: Any,
    spec: dict[str, Any],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> Any:
    b, phys = spec["batch"], spec["physical"]
    chunks = [(a, min(a + phys, b)) for a in range(0, b, phys)]
    if kind == "non-private":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def plain(i: int) -> None:
            xb, yb = batches[i % len(batches)]
            for a, z in chunks:
                xc, yc = xb[a:z].to(device), yb[a:z].to(device)
                (loss_fn(model(xc), yc) * ((z - a) / b)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        return plain
    if kind in ("vmap-clip", "ghost-clip"):
        from cocoon_ckpt.train.ghost import GhostGrads
        from cocoon_ckpt.train.grads import PerSampleGrads

        names = [k for k, _ in model.named_parameters()]
        grads = (GhostGrads if kind == "ghost-clip" else PerSampleGrads)(model, loss_fn, names)

        def clip_only(i: int) -> None:
            xb, yb = batches[i % len(batches)]
            grads.clipped_sum([xb.to(device), yb.to(device)], 1.0, spec["physical"])

        return clip_only
    if kind in ("vmap", "ghost", "ghost-overlap", "ghost-overlap-g1"):
        from cocoon_ckpt import DPConfig
        from cocoon_ckpt.train.data import Batch
        from cocoon_ckpt.train.trainer import DPTrainer

        n = int(batches[0][0].shape[0]) * len(batches)
        cfg = DPConfig(
            steps=10_000,
            batch_size=b,
            dataset_size=n,
            noise_multiplier=1.0,
            bands=spec["bands"],
            physical_batch_size=phys,
            clipping="vmap" if kind == "vmap" else "ghost",
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = (torch.cat([c[0] for c in batches]), torch.cat([c[1] for c in batches]))
        trainer = DPTrainer(
            model,
            opt,
            loss_fn,
            data,
            cfg,
            bytes(32),
            tiers=_tiers(spec),
            overlap_noise=kind.startswith("ghost-overlap"),
            # -g1: the gradients on one thread, the noise thread on the other core
            grad_threads=1 if kind.endswith("-g1") else None,
        )
        if spec.get("fill_ring"):
            _fill_ring(trainer.noise.state_rows)

        def ours(i: int) -> None:
            xb, yb = batches[i % len(batches)]
            idx = torch.arange(b, dtype=torch.int64)
            trainer.train_step(Batch(trainer.step_index, idx, (xb, yb), b))

        ours.trainer = trainer  # type: ignore[attr-defined]
        return ours
    return _opacus_step(kind, model, loss_fn, spec, batches, chunks, device)


def _tiers(spec: dict[str, Any]) -> Any:
    """The TierConfig of a `--host-budget` row: the host holds what fits in the budget,
    a far tier backed by a file in `--far-dir` the rest (None: all on the host)."""
    if spec.get("host_budget") is None:
        return None
    from cocoon_ckpt.tiers import TierConfig

    return TierConfig(
        device_bytes=0, host_bytes=spec["host_budget"], far_bytes=None, far_dir=spec["far_dir"]
    )


def _fill_ring(history: Any) -> None:
    """Write every ring slot once before the timed steps, as a job past step b-1 has:
    a far file's unwritten holes read as zeros without touching the disk."""
    g = torch.Generator().manual_seed(2)
    for slot in range(history.slots):
        history.write(slot, torch.randn(history.width, generator=g).numpy())


def _opacus_step(
    kind: str,
    model: nn.Module,
    loss_fn: Any,
    spec: dict[str, Any],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    chunks: list[tuple[int, int]],
    device: torch.device,
) -> Any:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    b = spec["batch"]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(*batches[0]), batch_size=b)
    engine = PrivacyEngine()
    mode = "ghost" if kind == "opacus-ghost" else "hooks"
    kw: dict[str, Any] = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
    made = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
        **kw,
    )
    dp_model, dp_opt = made[0], made[1]
    crit = made[2] if mode == "ghost" else nn.CrossEntropyLoss()
    dp_opt.expected_batch_size = b

    def opacus(i: int) -> None:
        xb, yb = batches[i % len(batches)]
        for j, (a, z) in enumerate(chunks):
            xc, yc = xb[a:z].to(device), yb[a:z].to(device)
            crit(dp_model(xc), yc).backward()
            # BatchMemoryManager's protocol: every chunk but the last skips the update
            dp_opt.signal_skip_step(do_skip=j < len(chunks) - 1)
            dp_opt.step()
            dp_opt.zero_grad()

    return opacus


def run(spec: dict[str, Any], kind: str) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--child", json.dumps({**spec, "kind": kind})]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  {kind}: failed: {done.stderr.strip().splitlines()[-1:]}")
        return None
    r: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return r


def table(spec: dict[str, Any], kinds: list[str]) -> dict[str, dict[str, Any]]:
    rows = {k: r for k in kinds if (r := run(spec, k)) is not None}
    base = rows.get("non-private")
    print(
        f"depth {spec['depth']}, d {spec['d']}, heads {spec['heads']}, seq {spec['seq']}, "
        f"batch {spec['batch']}, physical {spec['physical']}, bands {spec['bands']}, "
        f"{spec['device']}, {spec['threads']} threads, {spec['clock']} clock"
        + (f", {base['params'] / 1e6:.1f}M parameters" if base else "")
    )
    print(
        f"  {'contender':<16} {'s/step':>8} {'range':>15} {'first':>7} {'x plain':>8} "
        f"{'peak RSS MiB':>13} {'x plain':>8} {'steps MiB':>10} {'x plain':>8}"
        + ("  cuda peak MiB" if spec["device"] == "cuda" else "")
    )
    for k, r in rows.items():
        ratio = r["s"] / base["s"] if base else float("nan")
        mem = r["rss_mib"] / base["rss_mib"] if base else float("nan")
        own = r["step_mib"] / base["step_mib"] if base else float("nan")
        lo, hi = r["range"]
        line = (
            f"  {k:<16} {r['s']:8.3f} {lo:7.3f}-{hi:<7.3f} {r['first']:7.2f} {ratio:8.2f} "
            f"{r['rss_mib']:13.0f} {mem:8.2f} {r['step_mib']:10.0f} {own:8.2f}"
        )
        if "cuda_peak_mib" in r:
            line += f"  {r['cuda_peak_mib']:13.0f}"
        print(line)
    breakdown(rows, base)
    return rows


def _bytes(text: str) -> int:
    """'4GB', '512MiB', '1e9' as bytes (GB = 10^9, GiB = 2^30)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6}
    units |= {"gb": 10**9, "tb": 10**12, "b": 1}
    low = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * units[suffix])
    return int(float(low))


def far_table(
    spec: dict[str, Any], budget: int, far_dir: str, bands: list[int], cold: bool = False
) -> None:
    """Our ghost DP step with the ring on the host against the ring split over a host
    budget and a far tier on disk: at the smallest b, both (the same ring, the same
    bits); at the larger b, the far split alone (its ring need not fit in RAM). Every
    ring is written whole before the timed steps (steady state: no holes in the file).
    `cold`: the far file's pages are dropped from the page cache before each step."""
    base_b = min(bands)
    rows: list[tuple[str, int, dict[str, Any] | None]] = []
    host = {**spec, "bands": base_b, "fill_ring": True}
    rows.append(("all on host", base_b, run(host, "ghost")))
    for b in sorted(bands):
        tiered = {**host, "bands": b, "host_budget": budget, "far_dir": far_dir}
        tiered["far_cold"] = cold
        name = f"host {budget / 1e9:g} GB + far" + (" cold" if cold else "")
        rows.append((name, b, run(tiered, "ghost")))
    base = rows[0][2]
    print(
        f"\nring beyond host memory: ghost DP step, depth {spec['depth']}, d {spec['d']}, "
        f"batch {spec['batch']}, physical {spec['physical']}, far file in {far_dir}, "
        f"{spec['clock']} clock"
    )
    print(
        f"  {'ring':<25} {'b':>3} {'ring GB':>8} {'s/step':>8} {'range':>15} "
        f"{'x host b=' + str(base_b):>11} {'peak RSS MiB':>13} {'worker MiB':>11}"
        "  columns per tier"
    )
    for name, b, r in rows:
        if r is None:
            continue
        ring_gb = (b - 1) * r["params"] * 4 / 1e9
        ratio = r["s"] / base["s"] if base else float("nan")
        lo, hi = r["range"]
        print(
            f"  {name:<25} {b:>3} {ring_gb:8.2f} {r['s']:8.3f} {lo:7.3f}-{hi:<7.3f} "
            f"{ratio:11.2f} {r['rss_mib']:13.0f} {r.get('far_worker_mib', 0):11.0f}"
            + (f"  {r['plan']}" if "plan" in r else "")
        )


def bands_table(
    spec: dict[str, Any], bands: list[int], budget: int | None, far_dir: str | None
) -> None:
    """The step's cost against b in one table: the non-private step (before and after
    the DP rows, so the machine's drift shows) and our ghost DP step at each b, its ring
    written whole before the timed steps. A ring larger than `budget` runs as the far
    table does, over the host budget and a far file in `far_dir`; the rest all on the
    host. Under it, where each DP step's time goes."""
    rows: dict[str, dict[str, Any]] = {}
    where: dict[str, str] = {}
    first = run(spec, "non-private")
    for b in sorted(bands):
        sub = {**spec, "bands": b, "fill_ring": True, "breakdown": True}
        name = f"ghost b={b}"
        where[name] = "host"
        if budget is not None and far_dir is not None and (b - 1) * _params(spec) * 4 > budget:
            sub |= {"host_budget": budget, "far_dir": far_dir}
            where[name] = f"host {budget / 1e9:g} GB + far"
        if (r := run(sub, "ghost")) is not None:
            rows[name] = r
    last = run(spec, "non-private")
    plain = [r for r in (first, last) if r is not None]
    base = plain[0] if plain else None
    if base is not None:  # the ratios against the mean of the two plain runs
        base = {**base, "s": statistics.mean(r["s"] for r in plain)}
        base["rss_mib"] = statistics.mean(r["rss_mib"] for r in plain)
    print(
        f"\nthe step against b: depth {spec['depth']}, d {spec['d']}, heads {spec['heads']}, "
        f"seq {spec['seq']}, batch {spec['batch']}, physical {spec['physical']}, "
        f"{spec['threads']} threads, {spec['clock']} clock"
        + (f", {base['params'] / 1e6:.1f}M parameters" if base else "")
    )
    print(
        f"  {'contender':<18} {'ring GB':>8} {'ring on':<18} {'s/step':>8} {'range':>15} "
        f"{'first':>7} {'x plain':>8} {'peak RSS MiB':>13} {'x plain':>8} {'worker MiB':>11}"
    )
    for i, r in enumerate(plain):
        lo, hi = r["range"]
        print(
            f"  {'non-private ' + ('before' if i == 0 and first else 'after'):<18} {0:8.2f} "
            f"{'-':<18} {r['s']:8.3f} {lo:7.3f}-{hi:<7.3f} {r['first']:7.2f} "
            f"{r['s'] / base['s'] if base else float('nan'):8.2f} {r['rss_mib']:13.0f} "
            f"{r['rss_mib'] / base['rss_mib'] if base else float('nan'):8.2f} {0:11.0f}"
        )
    for name, r in rows.items():
        b = int(name.split("=")[1])
        lo, hi = r["range"]
        ratio = r["s"] / base["s"] if base else float("nan")
        mem = r["rss_mib"] / base["rss_mib"] if base else float("nan")
        print(
            f"  {name:<18} {(b - 1) * r['params'] * 4 / 1e9:8.2f} {where[name]:<18} "
            f"{r['s']:8.3f} {lo:7.3f}-{hi:<7.3f} {r['first']:7.2f} {ratio:8.2f} "
            f"{r['rss_mib']:13.0f} {mem:8.2f} {r.get('far_worker_mib', 0):11.0f}"
            + (f"  {r['plan']}" if "plan" in r else "")
        )
    breakdown(rows, base)


def _params(spec: dict[str, Any]) -> int:
    """Parameters of the model `spec` describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(
            spec["depth"], spec["d"], spec["heads"], spec["vocab"], spec["seq"], spec["classes"]
        )
    return sum(p.numel() for p in model.parameters())


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The transformer's shape options (bench/far_resume.py takes them too); `--85m`
    is applied by `model_shape`."""
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--85m", dest="gpt2", action="store_true", help="12 blocks, d 768, 12 heads")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--classes", type=int, default=16)


def model_shape(args: argparse.Namespace) -> None:
    """`--85m`: GPT-2 small's 12 blocks, d 768, 12 heads."""
    if args.gpt2:
        args.depth, args.d, args.heads = 12, 768, 12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8, help="logical batch (every step)")
    p.add_argument("--physical", type=int, default=4, help="examples per chunk")
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per contender")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="on CPU devices")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="also the 2-thread wall-clock table: plain and ghost steps given 2 threads, "
        "and ghost with `overlap_noise` (the noise in a thread beside the gradients)",
    )
    p.add_argument("--overlap-only", action="store_true", help="only that table")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[32, 128, 512],
        help="widths of the vmap/ghost crossover at depth 2 (none: skip)",
    )
    p.add_argument(
        "--sweep-seq",
        type=int,
        nargs="*",
        default=[8, 128],
        help="sequence lengths of the crossover at depth 2 and --d (none: skip)",
    )
    p.add_argument(
        "--host-budget",
        type=_bytes,
        default=None,
        help="with --far-dir: the ring-beyond-host-memory table, host budget in bytes "
        "(4GB, 512MiB)",
    )
    p.add_argument("--far-dir", help="folder of the far tier's file (a local disk)")
    p.add_argument(
        "--far-bands",
        type=int,
        nargs="+",
        default=[16, 32],
        help="b of the far-tier rows; all-on-host rows run at the smallest",
    )
    p.add_argument("--far-only", action="store_true", help="only the far-tier table")
    p.add_argument(
        "--far-cold",
        action="store_true",
        help="drop the far file from the page cache before each step (read from the disk)",
    )
    p.add_argument(
        "--bands-table",
        type=int,
        nargs="+",
        help="only the step against b: the non-private step and our ghost DP step at each "
        "b given (a ring over --host-budget on it and a far file in --far-dir)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="only peak RSS by owner and phase, ghost and vmap, with async checkpoints "
        "(bench/_scale_memory.py; its store in --far-dir or /var/tmp)",
    )
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    model_shape(args)
    spec = {
        k: getattr(args, k)
        for k in (
            "depth",
            "d",
            "heads",
            "seq",
            "vocab",
            "classes",
            "batch",
            "physical",
            "bands",
            "steps",
            "warmup",
            "threads",
            "device",
            "clock",
        )
    }
    if args.memory:
        import _scale_memory

        _scale_memory.report(spec, ["ghost", "vmap"], 4, 9, args.far_dir or "/var/tmp")
        return
    if args.bands_table:
        bands_table(spec, args.bands_table, args.host_budget, args.far_dir)
        return
    if args.far_dir is not None and args.host_budget is not None:
        far_table(spec, args.host_budget, args.far_dir, args.far_bands, args.far_cold)
        if args.far_only:
            return
    spec["breakdown"] = True
    opacus = importlib.util.find_spec("opacus") is not None
    if not opacus:
        print("(opacus is not importable: its rows are skipped)")
    if not args.overlap_only:
        # "-clip": the clipped sum alone (no noise, no optimizer), the clipping's own share
        kinds = ["non-private", "vmap", "ghost", "vmap-clip", "ghost-clip"]
        table(spec, kinds + (["opacus-hooks", "opacus-ghost"] if opacus else []))
    if args.overlap or args.overlap_only:
        # every contender gets the same 2 cores: torch's 2 intra-op threads for the plain
        # step; ours the same, with the noise beside the gradients (-g1: gradients on one
        # thread, the noise thread on the other core)
        print("\n2 threads, wall clock: the noise of step t beside its gradients")
        kinds = ["non-private", "ghost", "ghost-overlap", "ghost-overlap-g1"]
        table({**spec, "threads": 2, "clock": "wall"}, kinds + (["opacus-ghost"] if opacus else []))
        if args.overlap_only:
            return
    sweep = [("d", d, {"d": d, "heads": max(1, d // 64)}) for d in args.sweep]
    sweep += [("seq", t, {"seq": t}) for t in args.sweep_seq]
    if sweep:
        print(
            "\ncrossover: ghost / vmap per DP step (depth 2; d as given, seq as given at "
            f"d {args.d})"
        )
        print(
            f"  {'size':>9} {'params':>8} {'vmap s':>8} {'ghost s':>8} {'ghost/vmap':>11} "
            f"{'vmap MiB':>9} {'ghost MiB':>10}"
        )
        for what, value, change in sweep:
            sub = {**spec, "depth": 2, **change}
            v, g = run(sub, "vmap"), run(sub, "ghost")
            if v is None or g is None:
                continue
            print(
                f"  {what + ' ' + str(value):>9} {v['params'] / 1e6:7.2f}M {v['s']:8.3f} "
                f"{g['s']:8.3f} {g['s'] / v['s']:11.2f} {v['step_mib']:9.0f} {g['step_mib']:10.0f}"
            )


if __name__ == "__main__":
    main()
