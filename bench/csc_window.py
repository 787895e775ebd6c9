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

    python bench/csc_window.py --tools DIR [--tools-steps 100] [--tools-rows 20000]
                               [--tools-batch 2048] [--tools-dim 256] [--repeats 2]

`--tools`: `cocoon-ckpt audit` and `export` of a finished coalesced DLRM job (one table,
flat ids, its CSC read in windows of `--window` steps; trained once into DIR and reused)
each way in its own process, alternating: `stream`, the tools as they are (the CSC
verified a chunk at a time, audit's checks walking it in windows, `tools.csc_reads`),
and `whole`, the same tools made to read every CSC whole (`csc_reads.window_steps`
answering None: the path before they streamed). Prints peak RSS above the RSS after
the imports, wall time, and the ratios stream / whole; the two audits must give the
same report and the two exports the same bytes (checked).
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


def _tools_job(args: argparse.Namespace) -> Any:
    from cocoon_ckpt import DPConfig, JobConfig
    from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode

    b = args.bands
    return JobConfig(
        job="example:dlrm",
        # N = 2 b B keeps q = B b / N at 1/2; flat ids (Zipf 0.5) make most reads cold
        dp=DPConfig(
            steps=args.tools_steps,
            batch_size=args.tools_batch,
            dataset_size=2 * b * args.tools_batch,
            noise_multiplier=1.0,
            bands=b,
            seed=args.seed,
        ),
        options={"tables": [args.tools_rows], "dim": args.tools_dim, "dense": 4, "zipf": 0.5},
        checkpoint_every=max(args.tools_steps // 2, 1),
        lr=0.5,
        embedding=EmbeddingConfig(
            mode=TableMode("coalesced"),
            threat_model="final_model",
            hot_threshold=args.hot_threshold,
            csc_window_steps=args.window,
        ),
    )


def _tools_sizes(url: str) -> dict[str, Any]:
    """The CSC's and the table's bytes in the newest version, and the version count."""
    from state import Store

    store = Store.open(url, create=False)
    version = store.latest(verify=False)
    if version is None:
        raise SystemExit(f"{url} has no version: remove it and train again")
    metas = version.manifest.arrays
    return {
        "csc_mb": sum(m.nbytes for n, m in metas.items() if "/csc/" in n) / 2**20,
        "table_mb": sum(m.nbytes for n, m in metas.items() if n.startswith("model/tables")) / 2**20,
        "versions": len(store.versions()),
    }


def _tools_child(args: argparse.Namespace) -> dict[str, Any]:
    """One tool (`audit` or `export`), one way (`stream` or `whole`), in this process."""
    import hashlib

    from cocoon_ckpt.tools import csc_reads
    from cocoon_ckpt.tools.audit import audit_store
    from cocoon_ckpt.tools.export import export_model

    store, key = f"{args.tools}/store.zarr", f"{args.tools}/noise.key"
    tool, way = args.child.split("-")
    if way == "whole":
        csc_reads.window_steps = lambda manifest, param: None  # type: ignore[assignment]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if tool == "audit":
        report = audit_store(store, seed=args.seed, key_file=key, job="example:dlrm")
        digest = json.dumps(report.as_json(), sort_keys=True)
        if not report.ok:
            raise SystemExit(f"the audit found: {report.text()}")
    else:
        out = tempfile.mkdtemp(dir=args.tools) + "/model.pt"
        export_model(store, out, key_file=key)
        digest = Path(out).read_bytes().hex()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "tool": tool,
        "way": way,
        "wall_s": wall,
        "peak_above_mb": (peak - base) / 1024,
        "rss_before_mb": base / 1024,
        "sha": hashlib.sha256(digest.encode()).hexdigest()[:16],
    }


def _tools(args: argparse.Namespace, env: dict[str, str]) -> None:
    own = sys.argv[1:]
    root = Path(args.tools)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "store.zarr").exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, *own, "--child", "train"], check=True, env=env)
        print(f"trained the job in {time.perf_counter() - t0:.0f} s", flush=True)
    info = subprocess.run(
        [sys.executable, __file__, *own, "--child", "info"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    sizes = json.loads(info.stdout.strip().splitlines()[-1])
    csc = sizes["csc_mb"]
    print(
        f"CSC {csc:.0f} MB, table {sizes['table_mb']:.0f} MB, {sizes['versions']} versions",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for tool in ("audit", "export"):
            ways = ["stream", "whole"] if rep % 2 == 0 else ["whole", "stream"]
            got = {}
            for way in ways:
                out = subprocess.run(
                    [sys.executable, __file__, *own, "--child", f"{tool}-{way}"],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(r)
                got[way] = r
                print(
                    f"run {rep} {tool:6s} {way:6s}: {r['wall_s']:.1f} s, peak RSS "
                    f"{r['peak_above_mb']:.0f} MB above {r['rss_before_mb']:.0f} MB",
                    flush=True,
                )
            s, w = got["stream"], got["whole"]
            if s["sha"] != w["sha"]:
                raise SystemExit(f"{tool}: the two ways differ")
            print(
                f"run {rep} {tool} stream / whole: peak RSS above the imports "
                f"{s['peak_above_mb'] / w['peak_above_mb']:.2f} ({s['peak_above_mb']:.0f} "
                f"/ {w['peak_above_mb']:.0f} MB, CSC {csc:.0f} MB), wall "
                f"{s['wall_s'] / w['wall_s']:.2f}x; same {'report' if tool == 'audit' else 'bytes'}",
                flush=True,
            )


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
        "--tools",
        default=None,
        metavar="DIR",
        help="measure audit and export of a job's store in DIR (trained there once)",
    )
    ap.add_argument("--tools-steps", type=int, default=100)
    ap.add_argument("--tools-rows", type=int, default=20_000)
    ap.add_argument("--tools-batch", type=int, default=2048)
    ap.add_argument("--tools-dim", type=int, default=256)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "train":
        from cocoon_ckpt import run_job
        from cocoon_ckpt.train.options import JobOptions

        key = JobOptions(key_file=f"{args.tools}/noise.key")
        run_job(_tools_job(args), f"{args.tools}/store.zarr", options=key)
        return
    if args.child == "info":
        print(json.dumps(_tools_sizes(f"{args.tools}/store.zarr")))
        return
    if args.child is not None:
        child = _tools_child if args.tools is not None else _child
        print(json.dumps(child(args)))
        return
    own = sys.argv[1:]
    # the child imports cocoon_ckpt from this checkout, as the parent's caller did
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    if args.tools is not None:
        _tools(args, env)
        return
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
