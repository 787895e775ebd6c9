"""Bytes on disk against bytes the kept manifests reference, after retention and gc.

    python bench/retention.py [--optimizer adam] [--bands 8] [--every 2] [--keep 2]
                              [--steps 24] [--dir DIR]

Two runs of `example:mlp` in one process. The first keeps every version; on its store
the old rule, a version folder stays while any array in it is referenced, is projected
for the newest `--keep` versions, and then gc (retention by array) is run for real. The
second run keeps `--keep` versions as it goes (retention after every commit) and is
then gc'ed. "data" is every file under versions/ and shared/; the ratio is data over
the bytes of the arrays some manifest names (target <= 1.05).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from cocoon_ckpt import DPConfig, JobConfig, run_job
from state import Store
from state.paths import SHARED, VERSIONS
from state.reachability import referenced_arrays


def config(args: argparse.Namespace, keep_last: int) -> JobConfig:
    dp = DPConfig(
        steps=args.steps,
        batch_size=16,
        dataset_size=512,
        noise_multiplier=1.0,
        bands=args.bands,
        seed=0,
    )
    return JobConfig(
        job="example:mlp",
        dp=dp,
        optimizer=args.optimizer,
        checkpoint_every=args.every,
        keep_last=keep_last,
    )


def by_folder(store: Store, keep: int) -> tuple[int, int]:
    """(data bytes, referenced bytes) if the newest `keep` versions were kept and every
    version folder holding one of their arrays stayed whole (the rule before)."""
    sizes = store.backend.sizes("")
    referenced = referenced_arrays(store.manifest(v) for v in store.versions()[-keep:])
    folders = {"/".join(p.split("/")[:2]) for p in referenced if p.startswith(f"{VERSIONS}/")}
    data = sum(
        size
        for rel, size in sizes.items()
        if rel.startswith(f"{SHARED}/")
        or rel == f"{VERSIONS}/zarr.json"
        or "/".join(rel.split("/")[:2]) in folders
    )
    ref = sum(
        size
        for rel, size in sizes.items()
        if any(rel.startswith(p + "/") or rel == p for p in referenced)
    )
    return data, ref


def row(label: str, data: int, referenced: int) -> None:
    ratio = data / referenced if referenced else float("nan")
    unreferenced = 1 - referenced / data if data else 0.0
    print(f"{label:<38} {data:>11,} {referenced:>11,} {ratio:>7.3f} {unreferenced:>15.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    ap.add_argument("--bands", type=int, default=8)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    ap.add_argument("--keep", type=int, default=2, help="keep_last")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-retention-"))
    print(
        f"example:mlp, {args.optimizer}, bands {args.bands}, checkpoint every {args.every}, "
        f"keep_last {args.keep}, {args.steps} steps"
    )
    print(f"{'':<38} {'data bytes':>11} {'referenced':>11} {'ratio':>7} {'not referenced':>15}")
    try:
        url = str(root / "all.zarr")
        run_job(config(args, keep_last=10**6), url)
        store = Store.open(url, create=False)
        row(f"every version kept ({len(store.versions())})", *_space(store))
        row("by folder (the rule before), projected", *by_folder(store, args.keep))
        store.acquire_lease()
        store.retain(keep_last=args.keep)
        row("by array: gc", *_space(store))
        store.release_lease()

        url = str(root / "kept.zarr")
        run_job(config(args, keep_last=args.keep), url)
        store = Store.open(url, create=False)
        row("by array: retention during the job", *_space(store))
        store.acquire_lease()
        store.retain(keep_last=args.keep)
        row("by array: then gc", *_space(store))
        store.release_lease()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _space(store: Store) -> tuple[int, int]:
    space = store.space()
    return space.data, space.referenced


if __name__ == "__main__":
    main()
