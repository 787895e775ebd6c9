"""`cocoon-ckpt inspect`, `diff` and `gc`: the store-only commands, with their text
renderings. They start without torch or dp-accounting (tools.catalog is torch-free by
contract, and this module imports it only inside the handlers)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from cocoon_ckpt._cli.args import add_json, add_storage_options, storage_options

if TYPE_CHECKING:
    from cocoon_ckpt._cli.args import Subparsers

__all__ = ["add_parsers", "diff", "gc", "inspect", "size"]


def add_parsers(sub: Subparsers) -> None:
    """Add `inspect`, `diff` and `gc` to the top-level subcommands."""
    p = sub.add_parser(
        "inspect",
        help="list a store's versions: steps, sizes by kind, placement, threat model, epsilon, "
        "metrics",
        description="Read the manifests (no array is read) and describe every version: step, "
        "bytes written and referenced by kind (model, optimizer, ring, rng, csc), where the "
        "noise history lies, threat model and epsilon; the newest version's metrics (points "
        "and last value of the loss and of what the loop logged). With --version, that "
        "version's full config and array list.",
    )
    p.set_defaults(handler=inspect)
    p.add_argument("url", help="store URL")
    p.add_argument("--version", type=int, default=None, help="describe only this version")
    add_storage_options(p)
    add_json(p, "description")

    p = sub.add_parser(
        "diff",
        help="what changed between two versions",
        description="Arrays added, removed, changed, shared by path, and every record field "
        "that differs between versions V1 and V2 (manifests only).",
    )
    p.set_defaults(handler=diff)
    p.add_argument("url", help="store URL")
    p.add_argument("v1", type=int, help="older version")
    p.add_argument("v2", type=int, help="newer version")
    add_storage_options(p)
    add_json(p, "diff")

    p = sub.add_parser(
        "gc",
        help="delete all but the newest N versions and what nothing kept references",
        description="Keep the N newest versions (N >= 2) and the newest valid one; delete "
        "other manifests, unreferenced version folders and leftover .partial files. Takes the "
        "writer lease first, so it refuses while a job is writing.",
    )
    p.set_defaults(handler=gc)
    p.add_argument("url", help="store URL")
    p.add_argument("--keep", type=int, required=True, metavar="N", help="versions to keep (>= 2)")
    p.add_argument(
        "--takeover", action="store_true", help="take the lease even if its holder looks alive"
    )
    p.add_argument(
        "--discard-damaged",
        action="store_true",
        help="also delete versions whose manifest fails to verify and the arrays only they "
        "reference (without it a damaged manifest stops gc and nothing is deleted)",
    )
    add_storage_options(p)
    add_json(p, "result")


def size(n: float) -> str:
    """`n` bytes for people: 512 B, 1.5 KiB, ... up to GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def inspect(args: argparse.Namespace) -> int:
    """Describe the versions of store `args.url` (or one, with --version). Exit 0."""
    from cocoon_ckpt.tools.catalog import inspect_store

    out = inspect_store(args.url, version=args.version, storage_options=storage_options(args))
    if args.json:
        print(json.dumps(out))
    else:
        print("\n".join(_inspect_lines(out)))
    return 0


def _inspect_lines(out: dict[str, Any]) -> list[str]:
    lines = [f"{out['store']}: format {out['format_version']}, created {out['created']}"]
    job = out.get("job")
    if job:
        eps = job.get("target_epsilon")
        target = "" if eps is None else f" (calibrated once for epsilon={eps})"
        lines.append(
            f"job {job['job']} ({job['fingerprint']}): {job['steps_total']} steps, "
            f"b={job['bands']} {job['mechanism']}, sigma={job['noise_multiplier']}{target}, "
            f"m={job['dim']}, key in {job['key_location']}"
        )
        lines.append(f"threat model {job['threat_model']}: {job['threat_model_means']}")
        if job.get("grad_threads") is not None:
            n = job["grad_threads"]
            lines.append(f"gradients on {n} torch thread{'' if n == 1 else 's'} (kept on resume)")
    lines.append(
        f"{'version':>7} {'step':>6} {'written':>10} {'total':>10} {'epsilon':>9}  kinds written"
    )
    composed = False
    for v in out["versions"]:
        kinds = ", ".join(f"{k} {size(n)}" for k, n in v["bytes_written_by_kind"].items())
        eps = "-" if v["epsilon"] is None else f"{v['epsilon']:.4f}"
        if v["epsilon"] is not None and not v.get("epsilon_stored", True):
            eps += "*"
            composed = True
        done = " (complete)" if v["complete"] else ""
        lines.append(
            f"{v['version']:>7} {v['step']:>6} {size(v['bytes_written']):>10} "
            f"{size(v['bytes_total']):>10} {eps:>9}  {kinds}{done}"
        )
        for s in v["placement"]:
            lines.append(
                f"{'':>16}noise [{s['start']}, {s['stop']}) on {s['tier']}, {s['slots']} slots"
            )
        emb = v.get("embedding")
        if emb:
            paths = ", ".join(f"{n} {m}" for m, n in emb["modes"].items())
            csc = (
                f"; CSC {emb['csc_entries']:,} entries, {size(emb['csc_bytes'])} (shared, "
                f"precomputed in {emb['precompute_seconds']:.1f} s)"
                if emb["csc_entries"]
                else ""
            )
            lines.append(
                f"{'':>16}embedding: {emb['tables']} tables ({paths}), "
                f"{emb['hot_rows']:,} hot rows{csc}; cursor at step {emb['cursor']}"
            )
    if composed:
        lines.append(
            "* composed now from the version's accounting event (a version written mid-run "
            "does not store its epsilon; the job's last version does)"
        )
    lines.extend(_metrics_lines(out["versions"]))
    for d in out["damaged_manifests"]:
        lines.append(f"DAMAGED version {d['version']}: {d['error']}")
    sp = out.get("space")
    if sp:
        lines.append(
            f"data {size(sp['data_bytes'])}, referenced {size(sp['referenced_bytes'])}, "
            f"unreachable {size(sp['unreachable_bytes'])} (gc reclaims it), "
            f"in flight {size(sp['in_flight_bytes'])}; data / referenced {sp['data_ratio']:.3f}"
        )
        if sp["unreadable_versions"]:
            lines.append(
                f"retention deletes nothing while versions {sp['unreadable_versions']} fail to "
                "verify: run audit, then gc --discard-damaged to drop them"
            )
    holder = out["lease_holder"]
    if holder is None:
        writer = "none ever"
    else:
        state = "released" if holder.get("released") else "held"
        writer = f"{holder['owner']} (generation {holder['generation']}, {state})"
    lines.append(f"writer lease: {writer}; noise key in store: {out['key_in_store']}")
    return lines


def _metrics_lines(versions: list[dict[str, Any]]) -> list[str]:
    """The newest version's training curves: points and last value of each metric."""
    if not versions or versions[-1].get("metrics") is None:
        return []
    v = versions[-1]
    metrics = v["metrics"]
    if "error" in metrics:
        return [f"metrics of version {v['version']} cannot be read: {metrics['error']}"]
    shown = "; ".join(
        f"{name} {s['points']} points, last {s['last']:.4g} at step {s['last_step']}"
        for name, s in metrics.items()
    )
    return [f"metrics in version {v['version']}: {shown or 'none logged'}"]


def diff(args: argparse.Namespace) -> int:
    """Print what changed between versions `args.v1` and `args.v2`. Exit 0."""
    from cocoon_ckpt.tools.catalog import diff_versions

    d = diff_versions(args.url, args.v1, args.v2, storage_options=storage_options(args))
    if args.json:
        print(json.dumps(d))
        return 0
    print(
        f"version {args.v1} (step {d['from']['step']}) -> {args.v2} (step {d['to']['step']})"
        + ("" if d["same_job"] else "  DIFFERENT JOBS")
    )
    for key in ("added", "removed", "changed", "shared"):
        names = d[f"arrays_{key}"]
        print(
            f"  arrays {key:<8} {len(names):>4}  {' '.join(names[:6])}{' ...' * (len(names) > 6)}"
        )
    print(f"  bytes added     {size(d['bytes_added'])}")
    for k, ch in d["records_changed"].items():
        if k != "noise.shards":
            print(f"  {k}: {ch['from']!r} -> {ch['to']!r}")
    return 0


def gc(args: argparse.Namespace) -> int:
    """Keep the newest `args.keep` versions and delete the rest. Exit 0."""
    from cocoon_ckpt.tools.catalog import collect_garbage

    out = collect_garbage(
        args.url,
        keep=args.keep,
        storage_options=storage_options(args),
        takeover=args.takeover,
        discard_damaged=args.discard_damaged,
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"kept versions {out['versions_kept']}; deleted {len(out['deleted'])} paths, "
            f"freed {size(out['bytes_freed'])}"
        )
    return 0
