"""b = 1 at growing table sizes: the dense DP-SGD noise step against the lazy step, and
how their ratio grows with the tables (LazyDP reports 119x at 96 GB).

    python bench/lazy_scale.py [--gib 0.2 1 2.1] [--dim 16] [--batch 256] [--zipf fitted]
                               [--steps 40] [--timed 3]

Tables: the 26 Criteo Kaggle tables (`bench/dlrm.py`) scaled so they hold --gib GiB in
float32 at --dim (2.1 GiB is a little above full scale's 2.01 GiB: 35.2M rows); ids as
dlrm.py draws them (`--zipf fitted`: each table's exponent fitted to the published row
counts; see its docstring). For each size, in one process, one after the other (both
at once would hold the tables twice): a `DPTrainer` at b = 1 with the tables dense
(every row gets its Gaussian every step: DP-SGD) and one with lazy noise (a row's
missed steps drawn as one Gaussian when it is read; `cocoon_ckpt.embedding.lazy`), the
same model, data and key. It prints each median training step (gradients, clipping,
noise, update; one warm-up step first), dense / lazy, that ratio per GiB of table, and
the process's peak RSS after each size.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from dlrm import CRITEO_KAGGLE_EXAMPLES, build, exponents, make_data

from cocoon_ckpt import DPTrainer
from cocoon_ckpt.embedding import TableMode
from cocoon_ckpt.examples.dlrm import CRITEO_KAGGLE_ROWS, table_rows


def median_step(tr: DPTrainer, timed: int) -> float:
    tr.train_step()  # warm: vmap tracing, first touches of the tables
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        tr.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.2, 1.0, 2.1])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--zipf", default="fitted", help="an exponent, or 'fitted' (bench/dlrm.py)")
    ap.add_argument("--steps", type=int, default=40, help="n, the steps the job is set for")
    ap.add_argument("--timed", type=int, default=3, help="timed steps per trainer")
    args = ap.parse_args()
    full = sum(CRITEO_KAGGLE_ROWS) * args.dim * 4 / 2**30
    print(
        f"# b = 1, Criteo Kaggle tables x scale, dim {args.dim}, batch {args.batch}, Zipf "
        f"{args.zipf} ({CRITEO_KAGGLE_EXAMPLES:,} examples behind 'fitted'), "
        f"{torch.get_num_threads()} torch threads; full scale is {full:.2f} GiB"
    )
    print(
        f"{'GiB':>5} {'rows':>11} {'dense ms':>9} {'lazy ms':>8} {'ratio':>6} {'/GiB':>6} {'RSS GiB':>7}"
    )
    for gib in args.gib:
        scale = gib / full
        rows = table_rows("criteo-kaggle", scale)
        data = make_data(args.batch * 4, 13, rows, exponents(rows, args.zipf, scale), 2)
        got = {}
        for name, mode in (("dense", TableMode.DENSE), ("lazy", TableMode.LAZY)):
            tr = build(rows, args.dim, args.batch, 1, args.steps, args.zipf, mode, None, data)
            got[name] = median_step(tr, args.timed)
            tr.close()
            del tr
        ratio = got["dense"] / got["lazy"]
        size = sum(rows) * args.dim * 4 / 2**30
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"{size:5.2f} {sum(rows):>11,} {got['dense'] * 1e3:9.1f} {got['lazy'] * 1e3:8.1f} "
            f"{ratio:5.1f}x {ratio / size:6.1f} {rss:7.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
