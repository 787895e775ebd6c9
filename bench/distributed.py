"""Sharded noise history on torch.distributed: per-rank history bytes and noise step
time for 1, 2 and 4 ranks, side by side in one run; with --embedding, lazy embedding
noise (b = 1) drawn by 1 and 2 ranks instead.

    python bench/distributed.py [--dim 4194304] [--bands 16] [--reps 7] [--worlds 1 2 4]
    python bench/distributed.py --embedding [--rows 1000000] [--emb-dim 16]
        [--step-rows 8192] [--reps 7] [--worlds 1 2]
    python bench/distributed.py --coalesced [--ranks 2] [--scale 0.01] [--steps 40] [--keep-tiles]
        [--bands 8] [--batch 512] [--hot-threshold 8] [--rounds 2]

Each world size runs as real processes (gloo on CPU, NCCL where CUDA is present) on
this machine. A rank keeps only its shard of the (b-1) x dim history, draws its slice of
fresh noise, runs the fixed-order GEMV over its shard, and one all-gather gives every
rank the whole w_t. Printed per world size: the largest rank's history bytes and its
ratio to one process (target 1/world), the median noise step (slowest rank) with and
without the all-gather, and whether the gathered w_t equals the one-process w_t bit for
bit. On a 2-core machine, 4 ranks share 2 cores: the time column then measures
contention, not scaling; the bytes column is what sharding is for.

--embedding: one float32 table's lazy noise (`embedding.lazy.LazyNoise`, the draws of
each call split evenly by rank, then one all-gather): the median time of a step's draw
(--step-rows distinct rows, each with its own gap) and of the tails (every row, after
the last step), slowest rank, with and without the all-gather; the ratio to one process
measured in the same run; and whether the gathered updates equal one process's bit for
bit.

--coalesced: the DLRM example's job (Criteo Kaggle's 26 tables times --scale, dim 16,
Zipf ids) with coalesced embedding noise, run end to end by the real `train` command as
1 process and as --ranks processes (gloo; each rank precomputes and holds its part of
every table's CSC and the ranks gather each step's column, `embedding.csc_shards`),
alternating which goes first over --rounds rounds, one key for all. Printed per run: the
precompute (slowest rank), the time per training step after it (the job's only
checkpoint is its last: --checkpoint-every --steps), each as a ratio to the one-process
run of the same round (the step: the median `train_step`, slowest rank), each rank's
peak RSS, the CSC bytes each rank held, and whether
the final tables equal one process's up to the association of the gradient sums. With
--keep-tiles each round also runs the ranks with their precompute keeping no tiles in
the store (last in even rounds, first in odd ones) and prints the precompute with tiles
kept (each rank's in its own folder, `embedding.stored_tiles`) ÷ without.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cocoon_ckpt import BandMF, BandMFNoise
from cocoon_ckpt.embedding.lazy import LazyNoise, share_counts
from cocoon_ckpt.train.distributed import DistContext

KEY = bytes(range(32))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank, world)
    mech = BandMF.banded_sqrt(args.bands, 10_000)
    start, stop = ctx.bounds(args.dim)
    noise = BandMFNoise(mech, args.dim, KEY, 1.0, start=start, stop=stop)
    for _ in range(args.bands):  # fill the ring: the GEMV reads every slot from here on
        ctx.gather_noise(noise.step(), args.dim)
    local, full = [], []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        w = noise.step()
        t1 = time.perf_counter()
        whole = ctx.gather_noise(w, args.dim)
        t2 = time.perf_counter()
        local.append(t1 - t0)
        full.append(t2 - t0)
    digest = float(whole.double().sum()) if rank == 0 else None
    Path(out, f"{world}-{rank}.json").write_text(
        json.dumps(
            {
                "history_bytes": noise.history_bytes(),
                "local_s": statistics.median(local),
                "step_s": statistics.median(full),
                "t": noise.t,
                "w_sum": digest,
                "w": whole[:: max(1, args.dim // 4096)].tolist() if rank == 0 else None,
            }
        )
    )
    noise.close()
    dist.destroy_process_group()


def _lazy_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank, world)
    steps = 1000
    factors = np.full(steps, 0.01, dtype=np.float64)
    lazy = LazyNoise(KEY, args.emb_dim, 1.0, factors, np.float32, ranks=ctx)
    rng = np.random.default_rng(0)  # the same rows, gaps and segments on every rank
    rows = np.sort(rng.choice(args.rows, size=args.step_rows, replace=False)).astype(np.int64)
    seg = rng.integers(1, 50, size=rows.size)
    start = rng.integers(0, steps - 1, size=rows.size)
    every = np.arange(args.rows, dtype=np.int64)
    tail_seg = rng.integers(0, 50, size=every.size)
    tail_start = rng.integers(0, steps, size=every.size)
    times: dict[str, list[float]] = {"step_local": [], "step": [], "tail_local": [], "tail": []}
    digests = {}
    for name, call in (
        ("step", lambda: lazy.updates(rows, seg, start, steps - 1)),
        ("tail", lambda: lazy.updates(every, tail_seg, tail_start, steps)),
    ):
        call()  # warm: the first call pays for its allocations
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            got = call()
            t2 = time.perf_counter()
            times[name].append(t2 - t0)
        # the draw alone: this rank's share, no collective
        k = rows.size if name == "step" else every.size
        counts = share_counts(k, world)
        lo = sum(counts[:rank])
        local = LazyNoise(KEY, args.emb_dim, 1.0, factors, np.float32)
        r, sg, st = (rows, seg, start) if name == "step" else (every, tail_seg, tail_start)
        stop = steps - 1 if name == "step" else steps
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            local.updates(
                r[lo : lo + counts[rank]],
                sg[lo : lo + counts[rank]],
                st[lo : lo + counts[rank]],
                stop,
            )
            times[f"{name}_local"].append(time.perf_counter() - t0)
        digests[f"{name}_sha"] = hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest()
    Path(out, f"{world}-{rank}.json").write_text(
        json.dumps({**{k: statistics.median(v) for k, v in times.items()}, **digests})
    )
    dist.destroy_process_group()


def _embedding(args: argparse.Namespace) -> None:
    table = args.rows * args.emb_dim * 4
    print(
        f"# lazy noise (b = 1) of one float32 table: {args.rows:,} rows x {args.emb_dim} "
        f"({table / 2**20:.0f} MiB), {args.step_rows:,} rows a step; {os.cpu_count()} cores; "
        f"gloo; median of {args.reps}, slowest rank"
    )
    print(
        "world  step draw (local / gathered)   ÷ 1 rank   tails (local / gathered)      "
        "÷ 1 rank   updates vs 1 rank"
    )
    base: dict[str, float] = {}
    want: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            mp.spawn(_lazy_rank, args=(world, _port(), args, out), nprocs=world, join=True)
            recs = [json.loads(Path(out, f"{world}-{r}.json").read_text()) for r in range(world)]
            worst = {
                k: max(r[k] for r in recs) for k in ("step_local", "step", "tail_local", "tail")
            }
            base = base or worst
            want = want or {k: recs[0][k] for k in ("step_sha", "tail_sha")}
            same = all(r[k] == want[k] for r in recs for k in want)
            print(
                f"{world:>5}  {worst['step_local'] * 1e3:8.1f} ms / {worst['step'] * 1e3:8.1f} ms"
                f"   {worst['step'] / base['step']:6.2f}   "
                f"{worst['tail_local'] * 1e3:8.0f} ms / {worst['tail'] * 1e3:8.0f} ms"
                f"   {worst['tail'] / base['tail']:6.2f}   "
                f"{'bit-identical' if same else 'DIFFERS'}"
            )


#: One rank of the `train` command: its precompute's seconds, its median training step
#: (`DPTrainer.train_step`, the column gather included), the wall time from the end of
#: the precompute to the end of the job, its peak RSS and the CSC bytes it held, as JSON
#: in the file named by argv[1].
_RANK_RUN = r"""
import json, os, resource, statistics, sys, time
from cocoon_ckpt.embedding import tables
from cocoon_ckpt.train import trainer
from cocoon_ckpt._cli.main import main

out, marks, steps = sys.argv[1], {}, []
prepare = tables.EmbeddingNoise.prepare
train_step = trainer.DPTrainer.train_step

def timed_step(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return train_step(self, *a, **k)
    finally:
        steps.append(time.perf_counter() - t0)

trainer.DPTrainer.train_step = timed_step

def timed(self, *a, **k):
    if os.environ.get("BENCH_KEEP_TILES") == "0":  # the precompute keeps no tiles
        k["store"] = None
    secs = prepare(self, *a, **k)
    marks["precompute_s"], marks["after"] = secs, time.perf_counter()
    marks["csc_bytes"] = sum(e.csc.nbytes for e in self.engines if e.csc is not None)
    return secs

tables.EmbeddingNoise.prepare = timed
code = main(sys.argv[2:])
marks["train_s"] = time.perf_counter() - marks.pop("after")
marks["step_s"] = statistics.median(steps)
marks["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
marks["code"] = code
open(out, "w").write(json.dumps(marks))
sys.exit(code)
"""


def _coalesced_run(
    world: int, args: argparse.Namespace, root: Path, tag: str, keep: bool = True
) -> dict:
    """The job on `world` ranks (real processes, torchrun's environment); the slowest
    rank's precompute and training, every rank's RSS and CSC bytes. `keep`: the
    precompute keeps its tiles in the store (the job's default), else in memory only."""
    store = root / f"{tag}.zarr"
    train = [
        *("train", "--example", "dlrm", "--store", str(store), "--key-file", str(root / "k")),
        *("--job-option", "tables=criteo-kaggle", "--job-option", f"scale={args.scale}"),
        *("--job-option", "dim=16", "--steps", str(args.steps), "--bands", str(args.bands)),
        *("--batch-size", str(args.batch), "--dataset-size", str(args.batch * 64)),
        *("--embedding", "coalesced", "--threat-model", "final_model"),
        *("--hot-threshold", str(args.hot_threshold), "--checkpoint-every", str(args.steps)),
        "--no-progress",
    ]
    port = str(_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
        env["BENCH_KEEP_TILES"] = "1" if keep else "0"
        if world > 1:
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            env.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)})
        cmd = [sys.executable, "-c", _RANK_RUN, str(root / f"{tag}-{rank}.json"), *train]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() for p in procs):
        raise SystemExit(f"the {world}-rank run failed")
    recs = [json.loads((root / f"{tag}-{r}.json").read_text()) for r in range(world)]
    from cocoon_ckpt.format.stored import model_state
    from state import Store

    latest = Store.open(str(store), create=False).latest()
    assert latest is not None
    return {
        "precompute_s": max(r["precompute_s"] for r in recs),
        "step_s": max(r["step_s"] for r in recs),
        "train_s": max(r["train_s"] for r in recs),
        "rss_mib": [r["rss_mib"] for r in recs],
        "csc_mib": [r["csc_bytes"] / 2**20 for r in recs],
        "model": {k: np.asarray(v) for k, v in model_state(latest).items() if "tables" in k},
    }


def _coalesced(args: argparse.Namespace) -> None:
    from cocoon_ckpt.examples.dlrm import table_rows

    rows = sum(table_rows("criteo-kaggle", args.scale))
    print(
        f"# DLRM example, Criteo Kaggle x {args.scale} ({rows:,} rows, dim 16), b = "
        f"{args.bands}, B = {args.batch}, {args.steps} steps, hot threshold "
        f"{args.hot_threshold}; coalesced noise, 1 process against {args.ranks} ranks "
        f"(gloo); {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}"
    )
    print(
        "round  world  precompute  ÷ 1 proc   step     ÷ 1 proc   peak RSS / rank (MiB)"
        "   CSC / rank (MiB)   tables vs 1 proc"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rnd in range(args.rounds):
            order = [1, args.ranks] if rnd % 2 == 0 else [args.ranks, 1]
            # --keep-tiles: the ranks again, their tiles not kept (first in odd rounds)
            bare = None
            if args.keep_tiles and rnd % 2:
                bare = _coalesced_run(args.ranks, args, root, f"r{rnd}-bare", keep=False)
            got = {w: _coalesced_run(w, args, root, f"r{rnd}-w{w}") for w in order}
            if args.keep_tiles:
                if bare is None:
                    bare = _coalesced_run(args.ranks, args, root, f"r{rnd}-bare", keep=False)
                kept = got[args.ranks]["precompute_s"]
                print(
                    f"# round {rnd}: {args.ranks}-rank precompute with tiles kept "
                    f"{kept:.2f} s, without {bare['precompute_s']:.2f} s: "
                    f"{kept / bare['precompute_s']:.3f}x"
                )
            one = got[1]
            for w in (1, args.ranks):
                r = got[w]
                diff = max(
                    float(np.abs(r["model"][k] - one["model"][k]).max()) for k in one["model"]
                )
                print(
                    f"{rnd:>5}  {w:>5}  {r['precompute_s']:8.2f} s  {r['precompute_s'] / one['precompute_s']:7.2f}"
                    f"   {r['step_s'] * 1e3:6.1f} ms  {r['step_s'] / one['step_s']:7.2f}   "
                    f"{' '.join(f'{m:.0f}' for m in r['rss_mib']):>20}   "
                    f"{' '.join(f'{m:.1f}' for m in r['csc_mib']):>16}   max |diff| {diff:.1e}"
                )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--bands", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--embedding", action="store_true", help="lazy embedding noise instead")
    ap.add_argument("--rows", type=int, default=1_000_000, help="--embedding: table rows")
    ap.add_argument("--emb-dim", type=int, default=16, help="--embedding: table width")
    ap.add_argument("--step-rows", type=int, default=8192, help="--embedding: rows a step")
    ap.add_argument("--coalesced", action="store_true", help="coalesced DLRM job end to end")
    ap.add_argument("--ranks", type=int, default=2, help="--coalesced: ranks against 1")
    ap.add_argument("--scale", type=float, default=0.01, help="--coalesced: Criteo scale")
    ap.add_argument("--steps", type=int, default=40, help="--coalesced: training steps")
    ap.add_argument("--batch", type=int, default=512, help="--coalesced: batch size")
    ap.add_argument("--hot-threshold", type=int, default=8, help="--coalesced: hot rows")
    ap.add_argument("--rounds", type=int, default=2, help="--coalesced: alternating rounds")
    ap.add_argument(
        "--keep-tiles",
        action="store_true",
        help="--coalesced: also run the ranks with no precompute tiles kept (kept ÷ not)",
    )
    args = ap.parse_args()
    if args.coalesced:
        args.bands = args.bands if "--bands" in sys.argv else 8
        _coalesced(args)
        return
    if args.embedding:
        args.worlds = args.worlds or [1, 2]
        _embedding(args)
        return
    args.worlds = args.worlds or [1, 2, 4]
    print(
        f"# dim {args.dim:,}, b = {args.bands}, history {(args.bands - 1) * args.dim * 4 / 2**20:.0f}"
        f" MiB float32 in one process; {os.cpu_count()} cores; gloo"
    )
    print("world  history/rank   ratio   noise step (local / with all-gather)  w_t vs 1 rank")
    base_bytes = None
    base_w = None
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            mp.spawn(_rank, args=(world, _port(), args, out), nprocs=world, join=True)
            recs = [json.loads(Path(out, f"{world}-{r}.json").read_text()) for r in range(world)]
            hist = max(r["history_bytes"] for r in recs)
            local = max(r["local_s"] for r in recs)
            step = max(r["step_s"] for r in recs)
            w = np.array(recs[0]["w"])
            base_bytes = base_bytes or hist
            base_w = w if base_w is None else base_w
            same = "bit-identical" if np.array_equal(w, base_w) else "DIFFERS"
            print(
                f"{world:>5}  {hist / 2**20:9.1f} MiB  {hist / base_bytes:6.3f}   "
                f"{local * 1e3:8.1f} ms / {step * 1e3:8.1f} ms               {same}"
            )


if __name__ == "__main__":
    main()
