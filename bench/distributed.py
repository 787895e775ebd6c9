"""Sharded noise history on torch.distributed: per-rank history bytes and noise step
time for 1, 2 and 4 ranks, side by side in one run.

    python bench/distributed.py [--dim 4194304] [--bands 16] [--reps 7] [--worlds 1 2 4]

Each world size runs as real processes (gloo on CPU, NCCL where CUDA is present) on
this machine. A rank keeps only its shard of the (b-1) x dim history, draws its slice of
fresh noise, runs the fixed-order GEMV over its shard, and one all-gather gives every
rank the whole w_t. Printed per world size: the largest rank's history bytes and its
ratio to one process (target 1/world), the median noise step (slowest rank) with and
without the all-gather, and whether the gathered w_t equals the one-process w_t bit for
bit. On a 2-core machine, 4 ranks share 2 cores: the time column then measures
contention, not scaling; the bytes column is what sharding is for.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cocoon_ckpt import BandMF, BandMFNoise
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--bands", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
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
