"""DP-SGD (b=1) step time of our trainer against a non-private step on the same model
and batch size, and against Opacus when it is installed (optional), in one run.

    python bench/dp_step.py [--hidden 256] [--batch 64] [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.train.runner import build_trainer


def seconds_per_step(step, steps: int, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    n = args.batch * 64
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=args.steps + 5,
            batch_size=args.batch,
            dataset_size=n,
            noise_multiplier=1.0,
            bands=1,
        ),
        options={"hidden": args.hidden},
    )
    tr = build_trainer(cfg, bytes(32))
    ours = seconds_per_step(tr.train_step, args.steps)

    model = build_trainer(cfg, bytes(32)).model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tr.data.tensors
    g = torch.Generator().manual_seed(0)

    def plain_step() -> None:
        idx = torch.randint(0, n, (args.batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()

    plain = seconds_per_step(plain_step, args.steps)
    print(
        f"model dim {tr.dim}, batch {args.batch}: ours (DP-SGD, b=1) {ours * 1e3:.2f} ms/step, "
        f"non-private {plain * 1e3:.2f} ms/step, ratio {ours / plain:.2f}"
    )
    try:
        from opacus import PrivacyEngine
    except ImportError:
        print("opacus not installed (pip install opacus): its column is skipped")
        return
    om = build_trainer(cfg, bytes(32)).model
    oopt = torch.optim.SGD(om.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=args.batch
    )
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
        nn.functional.cross_entropy(om(xb), yb).backward()
        oopt.step()

    op = seconds_per_step(opacus_step, args.steps)
    print(f"opacus {op * 1e3:.2f} ms/step, ours / opacus {ours / op:.2f}")


if __name__ == "__main__":
    main()
