"""The noise step overlapped with the per-sample gradients against the two in sequence,
side by side in one run, same model, batch and noise.

    python bench/overlap.py [--hidden 1024] [--batch 64] [--bands 16] [--steps 12]

Prints the median step time of each, their ratio (overlapped / sequential; the
lower bound is max(noise, gradients) / (noise + gradients), also printed from the
parts measured alone), and whether both runs end with the same parameters bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from cocoon_ckpt import DPConfig, DPTrainer
from cocoon_ckpt.examples.mlp import make_data

KEY = bytes(range(32))


def trainer(args: argparse.Namespace, overlap: bool) -> DPTrainer:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 2)
    )
    n = args.batch * args.bands * 4
    x, y = make_data(n, args.features, 2, 0)
    cfg = DPConfig(
        steps=args.steps + args.bands + 1,
        batch_size=args.batch,
        dataset_size=n,
        noise_multiplier=1.0,
        bands=args.bands,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return DPTrainer(
        model,
        opt,
        torch.nn.functional.cross_entropy,
        (x, y),
        cfg,
        KEY,
        overlap_noise=overlap,
    )


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--features", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bands", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    runs = {}
    for overlap in (False, True):
        tr = trainer(args, overlap)
        for _ in range(args.bands):  # fill the ring
            tr.train_step()
        runs[overlap] = (tr, timed(tr.train_step, args.steps))
    seq, ovl = runs[False], runs[True]
    tr = seq[0]
    idx = torch.from_numpy(tr.sampler.batch(tr.step_index))
    t_grad = timed(lambda: tr.clipped_sum(idx), 5)
    noise = tr.noise
    saved = noise.state_dict()
    t_noise = timed(noise.step, 5)
    noise.load_state_dict(saved)
    same = all(
        torch.equal(a, b)
        for a, b in zip(seq[0].model.parameters(), ovl[0].model.parameters(), strict=True)
    )
    print(
        f"# MLP {args.features}-{args.hidden}-2, m = {tr.dim:,}, batch {args.batch}, "
        f"b = {args.bands}, {torch.get_num_threads()} torch threads"
    )
    print(f"gradients alone {t_grad * 1e3:.1f} ms, noise step alone {t_noise * 1e3:.1f} ms")
    print(
        f"sequential {seq[1] * 1e3:.1f} ms, overlapped {ovl[1] * 1e3:.1f} ms: "
        f"ratio {ovl[1] / seq[1]:.2f} (bound {max(t_grad, t_noise) / (t_grad + t_noise):.2f}); "
        f"parameters {'bit-identical' if same else 'DIFFER'}"
    )
    for t, _ in runs.values():
        t.close()


if __name__ == "__main__":
    main()
