"""DP-SGD (b=1) step time of our trainer against Opacus (when installed) and against a
non-private step, on the same model, batch size and data, measured in one run.

Two models: the mlp example (`--hidden`, `--batch`, the issue's "bench/dp_step.py model")
and a digits-sized MLP (64-64-10, Tanh, 1,437 examples, batch 20: examples/digits'
shape). Each round times every contender in turn (`--steps` steps after a warm-up);
rounds interleave them, so a neighbour's load on a shared machine falls on all of them
alike, and the ratios are taken within a round. Printed: each contender's median
ms/step and the median of the per-round ratios ours / opacus, ours-eager / opacus,
ours / ours-eager and ours / non-private. "ours" replays each chunk's recorded aten ops
(train.traced_grads, the default); "ours-eager" is the same trainer with
`trace_after=None`, the torch.func path on every chunk (the A/B of the replay, same
bits). The first chunk of each new Poisson batch size is recorded and checked against
eager, so early rounds of "ours" carry that one-time cost (its round range shows it);
the new sizes each round met are printed, and ours / opacus over the rounds that met
none (the steady state) beside the median over all rounds.

    python bench/dp_step.py [--hidden 256] [--batch 64] [--steps 50] [--rounds 7]
        [--threads 1] [--grad-threads N] [--model both|mlp|digits] [--clock wall|cpu]

`--threads` is the process's torch count (every contender's); ours takes its gradients,
clipping and optimizer step at a job's default count for the model's size (one thread
below 2^18 parameters: `train.grad_threads`) unless `--grad-threads` sets it.
bench/grad_threads.py compares the counts themselves.

Opacus is optional (`pip install opacus`, e.g. in a venv with --system-site-packages);
without it its column is skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.traced_grads import TracedChunk
from cocoon_ckpt.train.trainer import DPTrainer

Step = Callable[[], Any]


def seconds_per_step(
    step: Step, steps: int, warmup: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    for _ in range(warmup):
        step()
    t = clock()
    for _ in range(steps):
        step()
    return (clock() - t) / steps


def digits_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def mlp_job(hidden: int, batch: int, total: int) -> tuple[DPTrainer, Callable[[], nn.Module]]:
    """Our trainer of the mlp example, and a builder of the same initial model."""
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=total,
            batch_size=batch,
            dataset_size=batch * 64,
            noise_multiplier=1.0,
            bands=1,
        ),
        options={"hidden": hidden},
    )
    return build_trainer(cfg, bytes(32)), lambda: build_trainer(cfg, bytes(32)).model


def digits_job(batch: int, total: int) -> tuple[DPTrainer, Callable[[], nn.Module]]:
    """Our trainer of a digits-sized MLP on seeded data of load_digits' shape."""
    n = 1437
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    model = digits_model()
    cfg = DPConfig(steps=total, batch_size=batch, dataset_size=n, noise_multiplier=1.0, bands=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DPTrainer(model, opt, nn.functional.cross_entropy, (x, y), cfg, bytes(32)), digits_model


def contenders(
    trainer: DPTrainer, eager: DPTrainer, make_model: Callable[[], nn.Module], batch: int
) -> dict[str, Step]:
    """ours (replayed tapes: train.traced_grads), ours-eager (the vmap path every chunk,
    as before the tapes), non-private and (if installed) opacus steps on the same data."""
    x, y = trainer.data.tensors
    n = int(x.shape[0])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)

    def plain_step() -> None:
        idx = torch.randint(0, n, (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
        opt.step()

    eager.grads.trace_after = None  # the eager path on every chunk: the A/B baseline
    steps: dict[str, Step] = {
        "ours": trainer.train_step,
        "ours-eager": eager.train_step,
        "non-private": plain_step,
    }
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return steps
    om = make_model()
    oopt = torch.optim.SGD(om.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    # Poisson sampling (make_private's default), as ours
    om, oopt, loader = PrivacyEngine().make_private(
        module=om, optimizer=oopt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    it = iter(loader)

    def opacus_step() -> None:
        nonlocal it
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(loader)
            xb, yb = next(it)
        oopt.zero_grad()
        nn.functional.cross_entropy(om(xb), yb).backward()  # type: ignore[no-untyped-call]
        oopt.step()

    steps["opacus"] = opacus_step
    return steps


def compare(name: str, trainers: list[DPTrainer], steps: dict[str, Step], args: Any) -> None:
    trainer = trainers[0]
    times: dict[str, list[float]] = {k: [] for k in steps}
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    fresh: list[int] = []  # per round, the chunk sizes "ours" met for the first time
    for _ in range(args.rounds):
        before = _sizes_seen(trainer)
        for k, step in steps.items():
            times[k].append(seconds_per_step(step, args.steps, clock=clock))
        fresh.append(_sizes_seen(trainer) - before)
    med = {k: statistics.median(v) for k, v in times.items()}
    cols = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in med.items())
    print(f"{name} (dim {trainer.dim}): median ms/step ({args.clock} clock): {cols}")
    pairs = [("ours", "opacus"), ("ours-eager", "opacus"), ("ours", "ours-eager")]
    pairs.append(("ours", "non-private"))
    for ours, base in pairs:
        if base in times:
            ratios = [a / b for a, b in zip(times[ours], times[base], strict=True)]
            lo, hi = min(ratios), max(ratios)
            print(
                f"  {ours} / {base}: median {statistics.median(ratios):.2f} "
                f"(rounds {lo:.2f}-{hi:.2f})"
            )
    print(f"  new chunk sizes per round (recorded and checked once each): {fresh}")
    if "opacus" in times:
        # the rounds that met no new size: the steady state the one-time checks leave
        pairs_fresh = zip(times["ours"], times["opacus"], fresh, strict=True)
        steady = [a / b for a, b, f in pairs_fresh if f == 0]
        if steady:
            print(
                f"  ours / opacus in the {len(steady)} rounds with no new size: median "
                f"{statistics.median(steady):.2f} (rounds {min(steady):.2f}-{max(steady):.2f})"
            )
    if "opacus" not in steps:
        print("  opacus not installed (pip install opacus): its column is skipped")
    fns = [f for f in trainer.grads._chunk_fns.values() if isinstance(f, TracedChunk)]
    for f in fns:
        print(
            f"  ours: {len(f.checked)} chunk sizes replayed, {len(f.eager_sizes)} eager"
            + (f" (all eager: {f.reason})" if f.reason else "")
        )
    for t in trainers:
        t.close()


def _sizes_seen(trainer: DPTrainer) -> int:
    """Chunk sizes the trainer's replay has checked or left eager so far."""
    fns = [f for f in trainer.grads._chunk_fns.values() if isinstance(f, TracedChunk)]
    return sum(len(f.checked) + len(f.eager_sizes) for f in fns)


def _grad_threads(trainers: list[DPTrainer], n: int | None) -> None:
    """Run the trainers' gradients at `n` threads (None: the count each was built with,
    a new job's default), as a job built with `grad_threads=n` does."""
    for t in trainers if n is not None else []:
        t.grad_threads = n


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="the mlp model's batch")
    p.add_argument("--digits-batch", type=int, default=20)
    p.add_argument("--steps", type=int, default=50, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--grad-threads",
        type=int,
        default=None,
        help="ours' gradient threads (JobConfig.grad_threads; default: a new job's)",
    )
    p.add_argument("--model", choices=("both", "mlp", "digits"), default="both")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (time.thread_time), which a busy neighbour "
        "inflates far less than wall time; fair with --threads 1, where every "
        "contender computes on the calling thread",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    total = args.rounds * (args.steps + 3) + 10
    if args.model in ("both", "mlp"):
        (tr, make), (eager, _) = (mlp_job(args.hidden, args.batch, total) for _ in "ab")
        _grad_threads([tr, eager], args.grad_threads)
        compare(
            f"mlp hidden {args.hidden}, batch {args.batch}",
            [tr, eager],
            contenders(tr, eager, make, args.batch),
            args,
        )
    if args.model in ("both", "digits"):
        (tr, make), (eager, _) = (digits_job(args.digits_batch, total) for _ in "ab")
        _grad_threads([tr, eager], args.grad_threads)
        compare(
            f"digits MLP, batch {args.digits_batch}",
            [tr, eager],
            contenders(tr, eager, make, args.digits_batch),
            args,
        )


if __name__ == "__main__":
    main()
