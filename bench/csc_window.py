"""A coalesced table's CSC held whole against read in windows of steps (#32 item 3):
peak RSS, precompute time and the per-step cost of applying its entries, each way in
its own process (peak RSS is per process), alternating which goes first.

    python bench/csc_window.py [--rows 50000] [--dim 64] [--steps 400] [--reads 8192]
                               [--hot-threshold 50] [--window 8] [--repeats 2]
                               [--store-dir DIR]

`tiles`: the tiles computed and dropped (`precompute_into` with a sink that keeps
nothing): the precompute's own working set, which neither way avoids. `whole`:
`precompute_csc` in memory, then each step applies its column from the
in-memory CSC. `windows`: the precompute assembled in a local store
(`embedding.csc_assembly`), then each step applies its column from `CscWindows` (the
next window prefetched). Both apply column t with `index_add_` into a (rows, dim) table,
as `TableEngine.before_read` does, and the tails last; the two tables must end the same
bytes (checked). The rest of a DP step (gradients, hot rows' online noise) is the same
either way and is not run. Prints each run and the ratios windows / whole.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cocoon_ckpt import BandMF
    from cocoon_ckpt.embedding import AccessSchedule, precompute_csc, table_noise
    from cocoon_ckpt.embedding.csc_assembly import CscAssembly
    from cocoon_ckpt.embedding.csc_window import CscWindows
    from cocoon_ckpt.embedding.one_thread import one_thread
    from cocoon_ckpt.embedding.precompute import precompute_into
    from cocoon_ckpt.examples.dlrm import zipf_ids
    from state import Store

    rng = np.random.default_rng(args.seed)
    sched = AccessSchedule.from_step_rows(
        args.rows, [zipf_ids(args.rows, args.reads, 1.1, rng) for _ in range(args.steps)]
    )
    order = sched.noise_order()
    hot = int(np.count_nonzero(sched.counts > args.hot_threshold))
    noise = table_noise(bytes(range(32)), "emb.weight", args.rows, args.dim, 0.7, torch.float32)
    mech = BandMF.banded_sqrt(args.bands, args.steps)
    factors = np.full(args.steps, 0.01)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    resident = None
    if args.child == "tiles":  # the tiles computed and dropped: the precompute's own
        precompute_into(lambda _: None, sched, order, hot, args.dim, mech, noise, factors)
        return {
            "mode": "tiles",
            "precompute_s": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mb": base_rss / 1024,
        }
    if args.child == "whole":
        src: Any = precompute_csc(sched, order, hot, args.dim, mech, noise, factors)
    else:
        store = Store.open(tempfile.mkdtemp(dir=args.store_dir) + "/s.zarr")
        store.acquire_lease()
        assembly = CscAssembly(
            store, "emb.weight", sched, order, hot, args.dim, noise.np_dtype, args.window
        )
        try:
            precompute_into(assembly.add, sched, order, hot, args.dim, mech, noise, factors)
            stored, crcs = assembly.finish()
        finally:
            assembly.close()
        src = CscWindows(stored, args.window, crcs=crcs)
    precompute_s = time.perf_counter() - t0
    weight = torch.zeros(args.rows, args.dim, dtype=torch.float32)
    t1 = time.perf_counter()
    for t in range(args.steps + 1):
        rows, vals = src.column(t)
        if rows.size:
            with one_thread():  # as TableEngine.before_read applies a column
                weight.index_add_(0, torch.from_numpy(rows), torch.from_numpy(vals))
    apply_s = time.perf_counter() - t1
    if isinstance(src, CscWindows):
        resident = src.peak_resident_bytes
        src.close()
    return {
        "mode": args.child,
        "csc_mb": src.nbytes / 2**20,
        "entries": src.nnz,
        "hot": hot,
        "precompute_s": precompute_s,
        "step_ms": 1e3 * apply_s / (args.steps + 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_mb": base_rss / 1024,
        "resident_mb": None if resident is None else resident / 2**20,
        "table_sha": __import__("hashlib").sha256(weight.numpy().tobytes()).hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reads", type=int, default=8192, help="ids drawn per step (Zipf 1.1)")
    ap.add_argument("--hot-threshold", type=int, default=50)
    ap.add_argument("--bands", type=int, default=8)
    ap.add_argument("--window", type=int, default=8, help="--csc-window-steps")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store-dir", default=None, help="where the store goes (default: /tmp)")
    ap.add_argument(
        "--child", choices=["whole", "windows", "tiles"], default=None, help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args)))
        return
    own = sys.argv[1:]
    # the child imports cocoon_ckpt from this checkout, as the parent's caller did
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        modes = ["whole", "windows", "tiles"] if rep % 2 == 0 else ["tiles", "windows", "whole"]
        for mode in modes:
            out = subprocess.run(
                [sys.executable, __file__, *own, "--child", mode],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(r)
            if mode == "tiles":
                print(
                    f"run {rep} tiles    (computed and dropped: the precompute's own working "
                    f"set): precompute {r['precompute_s']:.1f} s, peak RSS "
                    f"{r['peak_rss_mb']:.0f} MB (before {r['rss_before_mb']:.0f} MB)",
                    flush=True,
                )
                continue
            held = "-" if r["resident_mb"] is None else f"{r['resident_mb']:.1f} MB"
            print(
                f"run {rep} {mode:8s} CSC {r['csc_mb']:.0f} MB ({r['entries']:,} entries, "
                f"H={r['hot']}): precompute {r['precompute_s']:.1f} s, apply "
                f"{r['step_ms']:.2f} ms/step, peak RSS {r['peak_rss_mb']:.0f} MB "
                f"(before the precompute {r['rss_before_mb']:.0f} MB), windows resident "
                f"{held}",
                flush=True,
            )
        pair = runs[-3:]
        w = next(r for r in pair if r["mode"] == "windows")
        h = next(r for r in pair if r["mode"] == "whole")
        base = next(r for r in pair if r["mode"] == "tiles")
        above = {k: r["peak_rss_mb"] - base["peak_rss_mb"] for k, r in (("w", w), ("h", h))}
        if w["table_sha"] != h["table_sha"]:
            raise SystemExit("the two tables differ: the windows changed the bits")
        print(
            f"run {rep} windows / whole: peak RSS above start "
            f"{(w['peak_rss_mb'] - w['rss_before_mb']) / (h['peak_rss_mb'] - h['rss_before_mb']):.3f}"
            f"; above the tiles' own peak: whole {above['h']:.0f} MB "
            f"({above['h'] / h['csc_mb']:.2f}x the CSC), windows {above['w']:.0f} MB "
            f"({above['w'] / h['csc_mb']:.2f}x)"
            f", precompute {w['precompute_s'] / h['precompute_s']:.2f}x, apply "
            f"{w['step_ms'] / h['step_ms']:.2f}x; same table bytes",
            flush=True,
        )


if __name__ == "__main__":
    main()
