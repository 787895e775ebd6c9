"""DLRM training step time: coalesced embedding noise with a hot/cold split against the
dense online mechanism, side by side in one run, on synthetic Zipf data.

    python bench/dlrm.py [--scale 0.02] [--dim 16] [--batch 1024] [--zipf 1.1]
                         [--steps 40] [--bands 2 4 8 16 32] [--timed 5]
                         [--lazy-scale 0.1] [--lazy-batch 256]

Tables: the 26 Criteo Kaggle tables (row counts as published with the DLRM reference)
times --scale. For every b, three trainers over the same model, data and noise key:

  CPU-GEMV   dense online BandMF over every table row, history on the host, host GEMV
  GPU-GEMV   the same, history pulled to the device tier and computed there (on a
             machine without CUDA the device tier is torch on the CPU: emulated)
  coalesced  threat_model="final_model", mode=auto: per table, hot rows online and the
             cold rows' noise precomputed into CSC (threshold from a quick profile), or
             the table left dense where coalescing does not pay

It prints the median training step (per-sample gradients, clipping, noise, update),
coalesced / better baseline, the tables coalesced, noise entries applied per step
against coalescing every read row and against the dense count (every row, every step),
CSC bytes against table bytes, the precompute time and end-to-end time over --steps
steps including it. Then b = 1: lazy DP-SGD noise (one Gaussian per gap, drawn when a
row is read) against dense DP-SGD noise over the whole tables, on --lazy-scale tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from cocoon_ckpt import DPConfig, DPTrainer
from cocoon_ckpt.embedding import EmbeddingConfig, TableMode, TableSpec
from cocoon_ckpt.examples.dlrm import DLRM, make_data, table_rows
from cocoon_ckpt.tiers import GemvMode, TierConfig

KEY = bytes(range(32))


def build(
    rows: list[int],
    dim: int,
    batch: int,
    bands: int,
    steps: int,
    zipf: float,
    mode: TableMode,
    tiers: TierConfig | None,
    data: tuple[torch.Tensor, ...],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.02, help="Criteo Kaggle rows times this")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--steps", type=int, default=40, help="n, steps the noise covers")
    ap.add_argument("--bands", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--timed", type=int, default=5, help="timed steps per engine")
    ap.add_argument("--lazy-scale", type=float, default=0.1)
    ap.add_argument("--lazy-batch", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = table_rows("criteo-kaggle", args.scale)
    n_data = args.batch * max(args.bands) * 2
    x, ids, y = make_data(n_data, 13, rows, args.zipf, 1)
    data = (x, ids, y)
    print(
        f"# tables: 26 Criteo Kaggle x {args.scale} = {sum(rows):,} rows, dim {args.dim} "
        f"({sum(rows) * args.dim * 4 / 2**20:.1f} MiB float32); batch {args.batch}, "
        f"Zipf {args.zipf}, n = {args.steps} steps, {n_data:,} examples; "
        f"device tier: {'cuda' if torch.cuda.is_available() else 'torch on CPU (emulated)'}"
    )
    print(
        "b   CPU-GEMV  GPU-GEMV  coalesced  ratio  tables  entries/step (all-cold, dense)  "
        "CSC/table  precompute  end-to-end ratio"
    )
    engines = {
        "CPU-GEMV": (TableMode.DENSE, TierConfig(mode=GemvMode.PULL_TO_HOST)),
        "GPU-GEMV": (TableMode.DENSE, TierConfig(device_bytes=None, mode=GemvMode.PULL_TO_DEVICE)),
        "coalesced": (TableMode.AUTO, None),
    }
    h3: list[str] = []
    for b in args.bands:
        res: dict[str, float] = {}
        stats: dict[str, Any] = {}
        pre = 0.0
        for name, (mode, tiers) in engines.items():
            tr = build(rows, args.dim, args.batch, b, args.steps, args.zipf, mode, tiers, data)
            assert tr.embedding is not None
            t0 = time.perf_counter()
            tr.embedding.prepare()
            if name == "coalesced":
                pre = time.perf_counter() - t0
                stats = coalesced_stats(tr)
            res[name] = step_time(tr, args.timed)
            tr.close()
            del tr
        base = min(res["CPU-GEMV"], res["GPU-GEMV"])
        e2e = (pre + args.steps * res["coalesced"]) / (args.steps * base)
        print(
            f"{b:<3} {res['CPU-GEMV'] * 1e3:7.1f}ms {res['GPU-GEMV'] * 1e3:7.1f}ms "
            f"{res['coalesced'] * 1e3:8.1f}ms  {base / res['coalesced']:5.2f}x  "
            f"{stats['coalesced']:2d}/26   {stats['per_step']:10,.0f} "
            f"({stats['reads_per_step']:,.0f}, {stats['rows']:,})  "
            f"{stats['csc_bytes'] / stats['table_bytes']:8.2f}x  {pre:8.1f}s   "
            f"{1 / e2e:5.2f}x"
        )
        h3.append(
            f"b={b}: threshold 3 would make {stats['h3_hot']:,} rows hot, "
            f"{stats['h3_per_step']:,.0f} entries/step, CSC/table "
            f"{stats['h3_csc_bytes'] / stats['table_bytes']:.2f}x"
        )
    print("\n".join(h3))
    # b = 1: lazy against dense DP-SGD noise
    lrows = table_rows("criteo-kaggle", args.lazy_scale)
    n_lazy = args.lazy_batch * 4
    lx, lids, ly = make_data(n_lazy, 13, lrows, args.zipf, 2)
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
