"""What keeping the precompute's tiles in the store costs: the coalesced tables of the
DLRM benchmark's job precomputed in memory (as before) and with every finished tile
written to a local store (`embedding.stored_tiles`), alternating per table which goes
first, so a drift in the machine's load falls on both sums alike.

    python bench/precompute_resume.py [--scale 0.02] [--bands 8] [--steps 40]
                                      [--batch 1024] [--dim 16] [--store-dir DIR]

Prints each table's two times, the sums, their ratio (the overhead of tile
checkpointing), the bytes the tiles took, and checks the two CSCs are the same bytes.
The store goes in --store-dir (default: a temporary folder: put it on the disk a real
job would use, fsync costs differ).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dlrm import build

from cocoon_ckpt.embedding import TableMode
from cocoon_ckpt.embedding.stored_tiles import StoredTiles, TileWriter
from cocoon_ckpt.examples.dlrm import make_data, table_rows
from state import Store


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.02, help="Criteo Kaggle rows times this")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--bands", type=int, default=8)
    ap.add_argument("--store-dir", default=None, help="where the store goes (default: /tmp)")
    args = ap.parse_args()

    rows = table_rows("criteo-kaggle", args.scale)
    data = make_data(args.batch * args.bands * 2, 13, rows, args.zipf, 1)
    tr = build(
        rows, args.dim, args.batch, args.bands, args.steps, args.zipf, TableMode.AUTO, None, data
    )
    assert tr.embedding is not None
    engines = [e for e in tr.embedding.engines if e.needs_precompute]
    with tempfile.TemporaryDirectory(dir=args.store_dir) as tmp:
        store = Store.open(f"{tmp}/bench.zarr")
        store.acquire_lease()
        mem_s = kept_s = 0.0
        tiles, writing = 0, 0.0
        for i, e in enumerate(engines):
            took: dict[str, float] = {}
            cscs = {}
            for how in ("memory", "store") if i % 2 == 0 else ("store", "memory"):
                t0 = time.perf_counter()
                if how == "memory":
                    cscs[how] = e.precompute(None, None)
                else:
                    # per table, its last write waited for: the job's one writer for every
                    # table also overlaps that one with the next table
                    with TileWriter() as writer:
                        digest = e.tile_digest("bench")
                        parts = StoredTiles(store, e.spec.param, digest, writer)
                        cscs[how] = e.precompute(None, parts)
                    tiles += parts.computed
                    writing += parts.write_seconds
                took[how] = time.perf_counter() - t0
            pairs = zip(
                cscs["memory"].arrays().values(), cscs["store"].arrays().values(), strict=True
            )
            for x, y in pairs:
                if x.dtype != y.dtype or x.tobytes() != y.tobytes():
                    raise SystemExit(f"{e.spec.param}: the kept precompute's CSC differs")
            mem_s += took["memory"]
            kept_s += took["store"]
            print(
                f"{e.spec.param:>18}: {e.rows - e.plan.hot:>9,} cold rows, "
                f"memory {took['memory']:7.2f} s, tiles kept {took['store']:7.2f} s"
            )
        kept = sum(
            f.stat().st_size for f in Path(tmp, "bench.zarr", "shared").rglob("*") if f.is_file()
        )
        csc = sum(e.csc.nbytes for e in engines if e.csc is not None)
        store.release_lease()
    print(
        f"b={args.bands} n={args.steps} scale={args.scale}: {len(engines)} coalesced tables, "
        f"{tiles} tiles; precompute in memory {mem_s:.2f} s, tiles kept {kept_s:.2f} s: "
        f"overhead {100 * (kept_s / mem_s - 1):+.1f}% (the tile writer was busy {writing:.2f} s, "
        f"{100 * writing / mem_s:.1f}% of the in-memory time, on its own thread); tiles {kept / 2**20:.1f} MiB on disk "
        f"for a {csc / 2**20:.1f} MiB CSC; CSCs bit-identical"
    )


if __name__ == "__main__":
    main()
