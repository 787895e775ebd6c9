"""Gradient thread count: a job's DP step at `grad_threads=1` against torch's default
count (2 on the development machine), wall time and process CPU time, in one run.

`grad_threads` (`train.grad_threads`) fixes the torch intra-op threads of the per-sample
gradients, clipping and optimizer step; the noise and everything else in the step run at
the process's count, as in a job. For each workload two trainers of the same job (same
model, data, key and Poisson batches) differ only in `grad_threads`; each round times
`--steps` steps of one then of the other, the order alternating between rounds, so a
neighbour's load falls on both alike. Per workload: the median ms/step of each count on
the wall clock (`time.perf_counter`) and on the process's CPU clock (`time.process_time`,
every thread of the process: two threads that spin count twice), and the median and range
of the per-round ratios 1 thread / N threads (below 1: one thread is faster or cheaper).
The header of each names its dense size m and the count a new job takes by default
(`grad_threads.default_grad_threads`).

Workloads (`--only` picks some):
  mlp          the mlp example, hidden 256, batch 64, b = 1 (bench/dp_step.py's default)
  mlp-wide     the same at hidden `--hidden` (default 2048), batch 256 (`dp_step.py
               --hidden 2048 --batch 256`)
  dp-digits    dp_step.py's digits-sized MLP, batch 20, b = 1
  digits-job   examples/digits' job (`--job examples.digits.run:build`): batch 128 in
               physical chunks of 32, 4 bands
  dlrm         bench/dlrm.py's coalesced DLRM (Criteo Kaggle tables x `--dlrm-scale`,
               dim 16, batch 1024, 8 bands), the two trainers sharing one CSC
  digits-cli   the digits job whole, as docs/getting-started.md runs it: `cocoon-ckpt train
               --job examples.digits.run:build --steps 44 ...` in a fresh process per
               run (start-up, 44 steps, checkpoints every 11 steps), `--grad-threads 1`
               against `--grad-threads N`; seconds per job, and the CPU time is the
               child's (`RUSAGE_CHILDREN`)
  gpt-vmap     bench/scale.py's transformer (`--d`, `--depth`, seq 32), logical batch 8
  gpt-ghost    in physical chunks of 4, 4 bands, clipping vmap / ghost

    python bench/grad_threads.py [--rounds 7] [--steps 5] [--threads 2] [--only mlp dlrm]
        [--hidden 2048] [--d 256] [--depth 4] [--dlrm-scale 0.02]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench/ modules, and examples/

from dp_step import digits_job, mlp_job  # noqa: E402

from cocoon_ckpt import DPConfig, JobConfig  # noqa: E402
from cocoon_ckpt.train.build import build_trainer  # noqa: E402
from cocoon_ckpt.train.grad_threads import default_grad_threads  # noqa: E402
from cocoon_ckpt.train.trainer import DPTrainer  # noqa: E402

Step = Callable[[], Any]
WORKLOADS = (
    "mlp",
    "mlp-wide",
    "dp-digits",
    "digits-job",
    "digits-cli",
    "dlrm",
    "gpt-vmap",
    "gpt-ghost",
)
#: the digits job of examples/digits/run.py's docstring, 4 epochs of 11 steps
DIGITS_CLI = [
    "train",
    "--job",
    "examples.digits.run:build",
    "--steps",
    "44",
    "--batch-size",
    "128",
    "--physical-batch-size",
    "32",
    "--dataset-size",
    "1437",
    "--lr",
    "0.5",
    "--bands",
    "4",
    "--checkpoint-every",
    "11",
    "--no-progress",
]


def pair(
    name: str, args: argparse.Namespace, total: int
) -> tuple[DPTrainer, DPTrainer, Step, Step]:
    """Two trainers of workload `name` (the first to run at 1 thread) and their steps."""
    if name in ("mlp", "mlp-wide"):
        hidden, batch = (256, 64) if name == "mlp" else (args.hidden, 256)
        a, b = (mlp_job(hidden, batch, total)[0] for _ in "ab")
    elif name == "dp-digits":
        a, b = (digits_job(20, total)[0] for _ in "ab")
    elif name == "digits-job":
        dp = DPConfig(
            steps=total,
            batch_size=128,
            physical_batch_size=32,
            dataset_size=1437,
            noise_multiplier=1.0,
            bands=4,
        )
        cfg = JobConfig(job="examples.digits.run:build", dp=dp, lr=0.5)
        a, b = (build_trainer(cfg, bytes(32)) for _ in "ab")
    elif name == "dlrm":
        a, b = _dlrm_pair(args, total)
    else:
        return _gpt_pair(name.removeprefix("gpt-"), args, total)
    return a, b, a.train_step, b.train_step


def _dlrm_pair(args: argparse.Namespace, total: int) -> tuple[DPTrainer, DPTrainer]:
    """bench/dlrm.py's coalesced trainer twice, the second taking the first's plans and
    CSCs (the same job: the same entries) instead of precomputing them again."""
    import dlrm

    from cocoon_ckpt.embedding import TableMode
    from cocoon_ckpt.examples.dlrm import table_rows

    rows = table_rows("criteo-kaggle", args.dlrm_scale)
    zipf = dlrm.exponents(rows, "1.1", args.dlrm_scale)
    data = dlrm.make_data(20 * 1024, 13, rows, zipf, 0)
    a = dlrm.build(rows, 16, 1024, 8, total, "1.1", TableMode.AUTO, None, data)
    assert a.embedding is not None
    a.embedding.prepare()
    plans = a.embedding.plans()
    b = dlrm.build(rows, 16, 1024, 8, total, "1.1", TableMode.AUTO, None, data, plans)
    dlrm.one_thread_grads(b, [e.csc for e in a.embedding.engines])  # sets 1: reset below
    return a, b


def _gpt_pair(
    clipping: str, args: argparse.Namespace, total: int
) -> tuple[DPTrainer, DPTrainer, Step, Step]:
    """bench/scale.py's transformer twice: a fixed logical batch of 8 (every step the same
    size, as scale.py's), chunks of 4."""
    import scale

    from cocoon_ckpt.train.data import Batch

    spec = {"depth": args.depth, "d": args.d, "heads": 4, "vocab": 1024, "seq": 32}
    spec |= {"classes": 16, "batch": 8}
    out: list[Any] = []
    for _ in "ab":
        model, x, y = scale.make(spec)
        cfg = DPConfig(
            steps=total,
            batch_size=8,
            dataset_size=int(x.shape[0]),
            noise_multiplier=1.0,
            bands=4,
            physical_batch_size=4,
            clipping=clipping,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        tr = DPTrainer(model, opt, torch.nn.functional.cross_entropy, (x, y), cfg, bytes(32))

        def step(tr: DPTrainer = tr, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            i = tr.step_index % 64
            idx = torch.arange(8 * i, 8 * i + 8)
            tr.train_step(Batch(tr.step_index, idx, (x[idx], y[idx]), 8))

        out += [tr, step]
    return out[0], out[2], out[1], out[3]


def timed(step: Step, steps: int) -> tuple[float, float]:
    """Seconds per step of `step`, (wall, process CPU)."""
    w, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - w) / steps, (time.process_time() - c) / steps


def cli_job(threads: int, folder: Path) -> tuple[float, float]:
    """Seconds of one whole digits job in a fresh process at `threads` gradient threads,
    (wall, the child's CPU)."""
    store = folder / f"d{threads}-{time.perf_counter_ns()}.zarr"
    cmd = [sys.executable, "-m", "cocoon_ckpt", *DIGITS_CLI, "--store", str(store)]
    cmd += ["--key-file", str(folder / "key"), "--grad-threads", str(threads)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    w = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=HERE.parent, capture_output=True)
    wall = time.perf_counter() - w
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    shutil.rmtree(store)
    return wall, cpu


def compare_cli(args: argparse.Namespace) -> None:
    got: dict[int, list[tuple[float, float]]] = {1: [], args.threads: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [1, args.threads] if r % 2 == 0 else [args.threads, 1]
            for n in order:
                got[n].append(cli_job(n, Path(tmp)))
    report(f"digits-cli (the whole job, {args.rounds} rounds)", "s/job", 1.0, got, args)


def report(
    head: str, unit: str, scale: float, got: dict[int, list[tuple[float, float]]], args: Any
) -> None:
    print(head + ":")
    for k, clock in enumerate(("wall", "cpu")):
        a = [x[k] for x in got[1]]
        b = [x[k] for x in got[args.threads]]
        ratios = [p / q for p, q in zip(a, b, strict=True)]
        print(
            f"  {clock:4s} {unit}: 1 thread {statistics.median(a) * scale:8.2f}  "
            f"{args.threads} threads {statistics.median(b) * scale:8.2f}  "
            f"1/{args.threads}: median {statistics.median(ratios):.2f} "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )
    sys.stdout.flush()


def compare(name: str, args: argparse.Namespace) -> None:
    if name == "digits-cli":
        compare_cli(args)
        return
    total = 2 * args.rounds * args.steps + 2 * args.warmup + 10
    one, many, step1, step_n = pair(name, args, total)
    one.grad_threads, many.grad_threads = 1, args.threads
    for _ in range(args.warmup):  # first uses: tapes recorded and checked, first touches
        step1()
        step_n()
    got: dict[int, list[tuple[float, float]]] = {1: [], args.threads: []}
    for r in range(args.rounds):
        order = [(1, step1), (args.threads, step_n)]
        for n, step in order if r % 2 == 0 else order[::-1]:
            got[n].append(timed(step, args.steps))
    for t in (one, many):
        t.close()
    params = sum(p.numel() for p in one.model.parameters())
    head = (
        f"{name} ({params:,} params, m = {one.dim:,} dense: new jobs' default "
        f"{default_grad_threads(one.dim)}), {args.rounds} rounds x {args.steps} steps"
    )
    report(head, "ms/step", 1e3, got, args)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--only", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and count")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="the other count (default: torch's, the count a new job took before)",
    )
    p.add_argument("--hidden", type=int, default=2048, help="mlp-wide's hidden width")
    p.add_argument("--d", type=int, default=256, help="the transformer's width")
    p.add_argument("--depth", type=int, default=4, help="the transformer's blocks")
    p.add_argument("--dlrm-scale", type=float, default=0.02)
    args = p.parse_args()
    print(f"torch threads {torch.get_num_threads()}; load {os.getloadavg()}")
    for name in args.only:
        compare(name, args)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
