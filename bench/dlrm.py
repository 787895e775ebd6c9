"""DLRM training step time: coalesced embedding noise with a hot/cold split against the
dense online mechanism, side by side in one run, on synthetic Zipf data.

    python bench/dlrm.py [--scale 0.02] [--dim 16] [--batch 1024] [--zipf 1.1]
                         [--steps 40] [--bands 2 4 8 16 32] [--timed 5]
                         [--precompute-threads N] [--serial-precompute]
                         [--sequential] [--fresh-floor] [--one-thread-grads]
                         [--lazy-scale 0.1] [--lazy-batch 256]

Tables: the 26 Criteo Kaggle tables (row counts as published with the DLRM reference,
33,762,577 rows in all) times --scale; the header lists the row counts used. Scale 0.1
is 3,376,257 rows (216 MiB at dim 16); its dense baselines hold (b-1) x that in history
each, so run it one engine at a time:

    python bench/dlrm.py --scale 0.1 --bands 8 --sequential --timed 3

Ids: `--zipf E` draws every table's ids from one power law, P(id = k) ~ (k+1)^-E
(default 1.1). `--zipf fitted` fits each table's exponent to Criteo Kaggle's published
statistics: the DLRM reference's row counts are the distinct values each feature takes
in the 45,840,617 examples of the challenge's train.txt, so every row was read at least
once there. Each table gets the steepest exponent (at most 1.1) under which its rarest
row is still expected once in that many examples (times --scale, as the rows are): a
steeper law would leave rows the published counts say were read. The big tables come
out nearly flat (the 10.1M-row table at ~0.78: 4.5 examples per row), the small ones
keep 1.1; the header prints each exponent.

Full scale (`--scale 1.0`, 33.8M rows, 2.0 GiB of table at dim 16): a dense baseline's
history is (b-1) x the tables, 14.1 GiB at b = 8, beyond a 10 GB budget. So
`--dense-scales A B` runs the four dense baselines on the tables times A and times B
and extrapolates each one's step time to --scale along the line through the two (their
step is a fixed part, the batch's gradients, plus noise over every row, so a tiny A
measures the fixed part and B the rate per row; an error at B grows by --scale / B);
the coalesced engine runs at --scale itself. The run that gave docs/benchmarks.md's full-scale row:

    python bench/dlrm.py --scale 1.0 --zipf fitted --bands 8 --steps 40 --timed 3 \
        --sequential --dense-scales 0.001 0.1 --lazy-scale 0.1

For every b, five trainers over the same model, data and noise key:

  CPU-GEMV   dense online BandMF over every table row, history on the host, the engine's
             fixed-order GEMV (split-invariant, compiled)
  GPU-GEMV   the same, history on the device tier, fixed-order GEMV computed there (on a
             machine without CUDA the device tier is torch on the CPU: emulated)
  CPU-BLAS   dense, host history, numpy `mix @ ring` (BLAS sgemv, all cores)
  dev-BLAS   dense, history a torch tensor on the device, `torch.mv` (cuBLAS; MKL on a
             machine without CUDA)
  coalesced  threat_model="final_model", mode=auto: per table, hot rows online and the
             cold rows' noise precomputed into CSC (threshold from a quick profile), or
             the table left dense where coalescing does not pay

BLAS is not split-invariant (bench/_dlrm_blas.py says why the engine does not use it),
but it is the fastest dense GEMV there is, so every ratio is against the fastest of the
four baselines, named in the `fastest` column. Steps are timed round-robin over the
engines (one step each per round, --timed rounds, medians), so a change in the load of
the machine falls on all of them alike; --sequential builds and times one engine at a
time instead, for tables too large to hold five trainers at once.

It prints the median training step (per-sample gradients, clipping, noise, update),
coalesced / fastest baseline, the tables coalesced, noise entries applied per step
against coalescing every read row and against the dense count (every row, every step),
CSC bytes against table bytes, the precompute time (tiles on --precompute-threads
threads; with --serial-precompute also one tile at a time, each tile on torch's
intra-op threads as before, its CSC checked equal bit for bit, and the ratio)
and end-to-end time over --steps steps including the precompute, against the fastest
baseline's, and the process's peak RSS once the coalesced engine has run; with --fresh-floor also the time to draw the precompute's fresh noise alone
(the same Gaussians as n dense steps draw for the cold rows, so a floor no tiling or
thread count goes below, and the end-to-end ratio a precompute costing only that would
give). With --one-thread-grads also a sixth engine, `coal-1thr`: the coalesced trainer
(sharing its CSC) with `grad_threads=1` (`--grad-threads 1`: its per-sample gradients,
clipping and optimizer step on one torch thread), timed in the same rounds. A job
chooses that when it starts: MKL's GEMMs give other bits on one thread than on two at
small row counts (chunks of 4-35 examples, float64 also 511), so the parameters differ
from a 2-thread job's, and the count is recorded and kept on resume. Then b = 1: lazy DP-SGD noise (one Gaussian per gap, drawn when a row is
read) against dense DP-SGD noise over the whole tables, on --lazy-scale tables.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from typing import Any

import numpy as np
import torch
from _dlrm_blas import BlasRing, TorchMvRing, use_ring

from cocoon_ckpt import DPConfig, DPTrainer
from cocoon_ckpt.embedding import EmbeddingConfig, TableMode, TableSpec, precompute_csc
from cocoon_ckpt.examples.dlrm import DLRM, table_rows, zipf_ids
from cocoon_ckpt.tiers import GemvMode, TierConfig
from cocoon_ckpt.tiers.device import default_device

KEY = bytes(range(32))
#: Examples in Criteo Kaggle's train.txt, in which the published row counts were seen.
CRITEO_KAGGLE_EXAMPLES = 45_840_617
#: The steepest exponent `--zipf fitted` gives a table (the bench's default law).
FITTED_CAP = 1.1


def rarest_row_mass(rows: int, exponent: float) -> float:
    """P(id = rows - 1) under `zipf_ids`' law (the continuous power law on
    [1, rows + 1), row k covering [k + 1, k + 2))."""
    a = 1.0 - exponent
    top = float(rows + 1) ** a
    return (top - float(rows) ** a) / (top - 1.0)


def fitted_exponent(rows: int, examples: float, cap: float = FITTED_CAP) -> float:
    """The steepest exponent <= cap under which the rarest of `rows` rows is expected
    at least once in `examples` draws (bisection; 1.0 itself is skipped, as zipf_ids
    refuses it)."""
    if rows < 2 or examples * rarest_row_mass(rows, cap) >= 1.0:
        return cap
    lo, hi = 1e-6, cap  # expected count of the rarest row falls as the exponent rises
    for _ in range(100):
        mid = (lo + hi) / 2
        if abs(mid - 1.0) < 1e-9:
            mid = 1.0 - 1e-6
        if examples * rarest_row_mass(rows, mid) >= 1.0:
            lo = mid
        else:
            hi = mid
    return lo


def exponents(rows: list[int], zipf: str, scale: float) -> list[float]:
    """Each table's exponent: --zipf's number, or fitted (module docstring)."""
    if zipf != "fitted":
        return [float(zipf)] * len(rows)
    return [fitted_exponent(r, CRITEO_KAGGLE_EXAMPLES * scale) for r in rows]


def make_data(
    n: int, dense: int, tables: list[int], zipf: list[float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cocoon_ckpt.examples.dlrm.make_data` with an exponent per table (the same draws
    in the same order, so one exponent for all gives its data)."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((n, dense)).astype(np.float32))
    ids = np.stack([zipf_ids(r, n, e, rng) for r, e in zip(tables, zipf, strict=True)], axis=1)
    w = rng.standard_normal(dense).astype(np.float32)
    logits = x.numpy() @ w + 0.5 * np.sin(ids.sum(axis=1))
    y = torch.from_numpy((logits > 0).astype(np.float32))
    return x, torch.from_numpy(ids), y


def peak_rss_gib() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(
    rows: list[int],
    dim: int,
    batch: int,
    bands: int,
    steps: int,
    zipf: str,
    mode: TableMode,
    tiers: TierConfig | None,
    data: tuple[torch.Tensor, ...],
    plans: dict[str, Any] | None = None,
) -> DPTrainer:
    torch.manual_seed(0)
    model = DLRM(13, rows, dim)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    n = int(data[0].shape[0])
    cfg = DPConfig(steps=steps, batch_size=batch, dataset_size=n, noise_multiplier=1.0, bands=bands)
    emb = EmbeddingConfig(
        tables=tuple(
            TableSpec(param=f"tables.{i}.weight", data_index=1, column=i) for i in range(len(rows))
        ),
        mode=mode,
        threat_model="intermediate_iterates" if mode is TableMode.DENSE else "final_model",
    )
    return DPTrainer(
        model,
        opt,
        torch.nn.functional.binary_cross_entropy_with_logits,
        data,
        cfg,
        KEY,
        embedding=emb,
        table_tiers=tiers,
        table_plans=plans,
    )


def step_time(tr: DPTrainer, timed: int) -> float:
    tr.train_step()  # warm: vmap tracing, first touches
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def coalesced_stats(tr: DPTrainer) -> dict[str, Any]:
    emb = tr.embedding
    assert emb is not None
    n = tr.config.steps
    out = {"coalesced": 0, "per_step": 0.0, "reads": 0, "rows": 0, "csc_bytes": 0}
    out["table_bytes"] = 0
    for e in emb.engines:
        out["rows"] += e.rows
        out["table_bytes"] += e.rows * e.dim * 4
        out["reads"] += e.schedule.events
        if e.plan.mode is TableMode.COALESCED and e.csc is not None:
            out["coalesced"] += 1
            # cold entries (tails are applied once, at the end) plus hot rows every step
            out["per_step"] += (e.csc.nnz - (e.rows - e.plan.hot)) / n + e.plan.hot
            out["csc_bytes"] += e.csc.nbytes
        else:
            out["per_step"] += e.rows  # dense: every row, every step
    out["reads_per_step"] = out["reads"] / n
    # Cocoon's operating point, threshold 3, from the schedule alone
    hot3 = cold3 = 0
    for e in emb.engines:
        counts = e.schedule.counts
        hot3 += int(np.count_nonzero(counts > 3))
        cold3 += int(counts[counts <= 3].sum())
    out["h3_hot"] = hot3
    out["h3_per_step"] = cold3 / n + hot3
    out["h3_csc_bytes"] = (cold3 + out["rows"] - hot3) * (emb.engines[0].dim * 4 + 8)
    return out


ENGINES: dict[str, tuple[TableMode, TierConfig | None]] = {
    "CPU-GEMV": (TableMode.DENSE, TierConfig(mode=GemvMode.PULL_TO_HOST)),
    "GPU-GEMV": (TableMode.DENSE, TierConfig(device_bytes=None, mode=GemvMode.PULL_TO_DEVICE)),
    "CPU-BLAS": (TableMode.DENSE, None),
    "dev-BLAS": (TableMode.DENSE, None),
    "coalesced": (TableMode.AUTO, None),
    "coal-1thr": (TableMode.AUTO, None),
}
BASELINES = ("CPU-GEMV", "GPU-GEMV", "CPU-BLAS", "dev-BLAS")


def make_engine(name: str, args: argparse.Namespace, b: int, rows: list[int], data: Any) -> Any:
    """A trainer for engine `name` at b bands, its rings in place and its CSC built:
    (trainer, precompute seconds, serial precompute seconds or None)."""
    mode, tiers = ENGINES[name]
    # coal-1thr takes the coalesced engine's plans (the profile is timed, so a second
    # choice could differ) and then its CSCs
    plans = args.plans if name == "coal-1thr" else None
    tr = build(rows, args.dim, args.batch, b, args.steps, args.zipf, mode, tiers, data, plans)
    assert tr.embedding is not None
    if name == "CPU-BLAS":
        use_ring(tr, BlasRing)
    elif name == "dev-BLAS":
        dev = default_device()
        use_ring(tr, lambda s, w, d: TorchMvRing(s, w, d, dev))
    if name == "coal-1thr":
        one_thread_grads(tr, args.csc)
        return tr, 0.0, None
    if name != "coalesced":
        return tr, 0.0, None
    if args.fresh_floor:
        args.floor[b] = fresh_floor(tr)
    # With --serial-precompute each table is built both ways, the two alternating which
    # goes first, so a drift in the machine's load falls on both sums alike.
    pre, serial = 0.0, 0.0 if args.serial_precompute else None
    for i, e in enumerate(e for e in tr.embedding.engines if e.needs_precompute):
        runs = [args.precompute_threads, 1] if i % 2 else [1, args.precompute_threads]
        if not args.serial_precompute:
            runs = [args.precompute_threads]
        got: dict[int | None, Any] = {}
        for threads in runs:
            t0 = time.perf_counter()
            got[threads] = csc_of(e, threads)
            took = time.perf_counter() - t0
            if threads == 1 and serial is not None:
                serial += took
            if threads == args.precompute_threads:
                pre += took
        if serial is not None:
            par = got[args.precompute_threads].arrays().values()
            for x, y in zip(got[1].arrays().values(), par, strict=True):
                if x.dtype != y.dtype or not np.array_equal(x, y):
                    raise SystemExit(f"{e.spec.param}: the parallel precompute's CSC differs")
        e.csc = got[args.precompute_threads]
    args.csc = [e.csc for e in tr.embedding.engines]
    args.plans = tr.embedding.plans()
    return tr, pre, serial


def one_thread_grads(tr: DPTrainer, cscs: list[Any]) -> None:
    """Take the coalesced engine's CSCs (the same job: the same entries) and run this
    trainer's per-sample gradients, clipping and optimizer step on one torch thread, as
    a job built with `grad_threads=1` does."""
    assert tr.embedding is not None
    for e, csc in zip(tr.embedding.engines, cscs, strict=True):
        if csc is not None:
            e.set_csc(csc)
    tr.grad_threads = 1


def fresh_floor(tr: DPTrainer) -> float:
    """Seconds to draw, alone, the fresh noise the precompute draws: every cold
    coordinate of every coalesced table at every step (the same Gaussians, bit for bit,
    as n dense steps draw for those rows), on torch's threads."""
    assert tr.embedding is not None
    t0 = time.perf_counter()
    for e in tr.embedding.engines:
        if e.plan.mode is TableMode.COALESCED and e.rows > e.plan.hot:
            for t in range(tr.config.steps):
                e.noise.fresh(t, e.plan.hot * e.dim, e.rows * e.dim)
    return time.perf_counter() - t0


def csc_of(e: Any, threads: int | None) -> Any:
    """Table engine e's CSC, tiles on `threads` threads (1: one tile at a time, each on
    torch's intra-op threads; None: the library's default, all cores)."""
    return precompute_csc(
        e.schedule, e.order, e.plan.hot, e.dim, e.mechanism, e.noise, e.factors,
        tile_rows=e.tile_rows, threads=threads,
    )  # fmt: skip


def time_engines(
    names: list[str], args: argparse.Namespace, b: int, rows: list[int], data: Any
) -> tuple[dict[str, float], float, float | None, dict[str, Any]]:
    """Median step of each engine; precompute seconds (parallel, serial); coalesced stats."""
    times: dict[str, list[float]] = {n: [] for n in names}
    pre, serial, stats = 0.0, None, {}

    def one(tr: DPTrainer, name: str) -> None:
        t0 = time.perf_counter()
        tr.train_step()
        times[name].append(time.perf_counter() - t0)

    groups = [[n] for n in names] if args.sequential else [names]
    for group in groups:
        live: dict[str, DPTrainer] = {}
        for name in group:
            tr, p, s = make_engine(name, args, b, rows, data)
            if name == "coalesced":
                pre, serial, stats = p, s, coalesced_stats(tr)
            tr.train_step()  # warm: vmap tracing, first touches
            live[name] = tr
        for _ in range(args.timed):
            for name, tr in live.items():
                one(tr, name)
        for tr in live.values():
            tr.close()
        del live
    return {n: statistics.median(v) for n, v in times.items()}, pre, serial, stats


def extrapolated_baselines(
    args: argparse.Namespace, b: int, rows: list[int], notes: list[str]
) -> dict[str, float]:
    """Each dense baseline's step at --scale, on the line through its medians at the two
    --dense-scales (data drawn as at --scale, with those scales' rows and exponents)."""
    pts: dict[str, list[tuple[int, float]]] = {n: [] for n in BASELINES}
    n_data = args.batch * max(args.bands) * 2
    for scale in args.dense_scales:
        srows = table_rows("criteo-kaggle", scale)
        sdata = make_data(n_data, 13, srows, exponents(srows, args.zipf, scale), 1)
        res, _, _, _ = time_engines(list(BASELINES), args, b, srows, sdata)
        for n in BASELINES:
            pts[n].append((sum(srows), res[n]))
    out = {}
    for n, ((r0, t0), (r1, t1)) in pts.items():
        slope = (t1 - t0) / (r1 - r0)
        out[n] = t0 + slope * (sum(rows) - r0)
        notes.append(
            f"b={b}: {n} measured {t0 * 1e3:.1f} ms at {r0:,} rows, {t1 * 1e3:.1f} ms at "
            f"{r1:,}: {slope * 1e9:.1f} ns/row + {(t0 - slope * r0) * 1e3:.1f} ms, "
            f"{out[n] * 1e3:.0f} ms at {sum(rows):,} rows"
        )
    if not all(math.isfinite(t) and t > 0 for t in out.values()):
        raise SystemExit(
            "\n".join(notes) + "\nan extrapolated dense step is not positive (the machine's "
            "noise is larger than the rows' cost between the two scales): rerun with a "
            "larger B in --dense-scales or more --timed steps"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.02, help="Criteo Kaggle rows times this")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument(
        "--zipf", default="1.1", help="one exponent for all tables, or 'fitted' (docstring)"
    )
    ap.add_argument(
        "--dense-scales",
        type=float,
        nargs=2,
        default=None,
        metavar=("A", "B"),
        help="time the dense baselines at these scales, extrapolated to --scale",
    )
    ap.add_argument("--steps", type=int, default=40, help="n, steps the noise covers")
    ap.add_argument("--bands", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--timed", type=int, default=5, help="timed steps per engine")
    ap.add_argument(
        "--precompute-threads", type=int, default=None, help="tiles at once (default: all cores)"
    )
    ap.add_argument(
        "--serial-precompute",
        action="store_true",
        help="also precompute on one thread: its time, and the CSC checked bit-equal",
    )
    ap.add_argument("--sequential", action="store_true", help="one engine alive at a time")
    ap.add_argument(
        "--fresh-floor",
        action="store_true",
        help="also time drawing the precompute's fresh noise alone (its floor)",
    )
    ap.add_argument(
        "--one-thread-grads",
        action="store_true",
        help="also time the coalesced trainer with grad_threads=1 (gradients on one thread)",
    )
    ap.add_argument("--lazy-scale", type=float, default=0.1)
    ap.add_argument("--lazy-batch", type=int, default=256)
    args = ap.parse_args()
    args.floor = {}
    if args.zipf != "fitted" and not float(args.zipf) > 0:
        raise SystemExit(f"--zipf {args.zipf}: give an exponent > 0 (not 1) or 'fitted'")
    rows = table_rows("criteo-kaggle", args.scale)
    exps = exponents(rows, args.zipf, args.scale)
    n_data = args.batch * max(args.bands) * 2
    x, ids, y = make_data(n_data, 13, rows, exps, 1)
    data = (x, ids, y)
    dev = default_device()
    threads = args.precompute_threads or torch.get_num_threads()
    print(
        f"# tables: 26 Criteo Kaggle x {args.scale} = {sum(rows):,} rows, dim {args.dim} "
        f"({sum(rows) * args.dim * 4 / 2**20:.1f} MiB float32); batch {args.batch}, "
        f"Zipf {args.zipf}, n = {args.steps} steps, {n_data:,} examples; "
        f"device: {'cuda' if dev.type == 'cuda' else 'torch on CPU (emulated)'}; "
        f"{torch.get_num_threads()} threads, precompute on {threads}"
    )
    print(f"# rows per table: {rows}")
    print(f"# Zipf exponent per table ({args.zipf}): {[round(e, 3) for e in exps]}")
    if args.dense_scales:
        print(
            f"# dense baselines timed at scales {args.dense_scales[0]} and "
            f"{args.dense_scales[1]}, extrapolated to {args.scale} (docstring)"
        )
    print(
        "b   CPU-GEMV  GPU-GEMV  CPU-BLAS  dev-BLAS  coalesced  fastest    ratio  tables  "
        "entries/step (all-cold, dense)  CSC/table  precompute (tile-serial)  end-to-end"
    )
    h3: list[str] = []
    for b in args.bands:
        names = [n for n in ENGINES if n != "coal-1thr" or args.one_thread_grads]
        if args.dense_scales:
            # the coalesced engine at full scale first: the peak RSS is its own
            res, pre, serial, stats = time_engines(
                [n for n in names if n not in BASELINES], args, b, rows, data
            )
            h3.append(f"b={b}: peak RSS after the coalesced engine {peak_rss_gib():.2f} GiB")
            res.update(extrapolated_baselines(args, b, rows, h3))
        else:
            res, pre, serial, stats = time_engines(names, args, b, rows, data)
            h3.append(f"b={b}: peak RSS {peak_rss_gib():.2f} GiB")
        fastest = min(BASELINES, key=lambda n: res[n])
        base = res[fastest]
        e2e = (pre + args.steps * res["coalesced"]) / (args.steps * base)
        one = f"({serial:.1f}s, {serial / pre:.2f}x)" if serial is not None else ""
        print(
            f"{b:<3} "
            + " ".join(f"{res[n] * 1e3:7.1f}ms" for n in BASELINES)
            + f" {res['coalesced'] * 1e3:8.1f}ms  {fastest:9} {base / res['coalesced']:5.2f}x  "
            f"{stats['coalesced']:2d}/26   {stats['per_step']:10,.0f} "
            f"({stats['reads_per_step']:,.0f}, {stats['rows']:,})  "
            f"{stats['csc_bytes'] / stats['table_bytes']:8.2f}x  {pre:7.1f}s {one:14}  "
            f"{1 / e2e:5.2f}x"
        )
        if b in args.floor:
            fl = args.floor[b]
            h3.append(
                f"b={b}: the precompute's fresh noise alone takes {fl:.1f}s "
                f"({fl / pre:.2f} of the precompute); end-to-end with a precompute costing "
                f"only that: {args.steps * base / (fl + args.steps * res['coalesced']):.2f}x"
            )
        if "coal-1thr" in res:
            h3.append(
                f"b={b}: coalesced at grad_threads=1 (a job setting; other bits than 2 threads) "
                f"{res['coal-1thr'] * 1e3:.1f} ms: {base / res['coal-1thr']:.2f}x the fastest "
                f"baseline, {res['coalesced'] / res['coal-1thr']:.2f}x the coalesced step"
            )
        h3.append(
            f"b={b}: threshold 3 would make {stats['h3_hot']:,} rows hot, "
            f"{stats['h3_per_step']:,.0f} entries/step, CSC/table "
            f"{stats['h3_csc_bytes'] / stats['table_bytes']:.2f}x"
        )
    print("\n".join(h3))
    # b = 1: lazy against dense DP-SGD noise (no history, so no GEMV to choose)
    lrows = table_rows("criteo-kaggle", args.lazy_scale)
    n_lazy = args.lazy_batch * 4
    lx, lids, ly = make_data(n_lazy, 13, lrows, exponents(lrows, args.zipf, args.lazy_scale), 2)
    out = {}
    for name, mode in (("dense DP-SGD", TableMode.DENSE), ("lazy", TableMode.LAZY)):
        tr = build(
            lrows, args.dim, args.lazy_batch, 1, args.steps, args.zipf, mode, None, (lx, lids, ly)
        )
        out[name] = step_time(tr, args.timed)
        tr.close()
    print(
        f"b=1 on {sum(lrows):,} rows x {args.dim} ({sum(lrows) * args.dim * 4 / 2**20:.0f} MiB), "
        f"batch {args.lazy_batch}: dense DP-SGD {out['dense DP-SGD'] * 1e3:.1f} ms, "
        f"lazy {out['lazy'] * 1e3:.1f} ms: {out['dense DP-SGD'] / out['lazy']:.1f}x"
    )


if __name__ == "__main__":
    main()
