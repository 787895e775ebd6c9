"""Read a store's catalogue: what each version holds, what changed, what to delete.

Manifests only (no array is read) and nothing heavier than `state` is imported, so the
commands built on this (`inspect`, `diff`, `gc`) start at once. The one exception: a
version written mid-run stores its accounting event but not its epsilon (only a job's
last version does: composing it at every checkpoint cost the training more than the
write), so `inspect` composes it from the config, importing dp-accounting (~1 s) the
first time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.format.metrics import METRICS_RECORD, MetricsError, read_metrics
from cocoon_ckpt.format.packed import packed_nbytes
from cocoon_ckpt.layout import KEY_SECRET, THREAT_MODEL_DEFAULT, THREAT_MODELS, array_kind
from cocoon_ckpt.records import EmbeddingRecord
from cocoon_ckpt.tools.guarantee import describe
from state import CorruptVersionError, Manifest, Store
from state.paths import version_prefix
from state.retention import OnDamage, verified_manifests

__all__ = ["collect_garbage", "diff_versions", "inspect_store", "own_prefix", "placement"]


def placement(noise: dict[str, Any]) -> list[dict[str, Any]]:
    """Where the history lay when a version was written: (start, stop, tier, slots)
    per tier shard. Versions from before tiers existed held it all on the host."""
    slots = sum(len(s["slots"]) for s in noise.get("shards", []))
    where = noise.get("placement") or [
        {"tier": s.get("tier", "host"), "start": s["start"], "stop": s["stop"]}
        for s in noise.get("shards", [])
    ]
    return [
        {"start": p["start"], "stop": p["stop"], "tier": p["tier"], "slots": slots} for p in where
    ]


def own_prefix(m: Manifest) -> str:
    return version_prefix(m.version)


def _version_summary(m: Manifest) -> dict[str, Any]:
    rec = m.records
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, meta in m.arrays.items():
        k = array_kind(name)
        total[k] = total.get(k, 0) + meta.nbytes
        if meta.path.startswith(own_prefix(m)):
            own[k] = own.get(k, 0) + meta.nbytes
    # the generators' states a version packs into its rng record are its own bytes too
    packed = rec.get("rng", {}).get("packed") if isinstance(rec.get("rng"), dict) else None
    for state in packed.values() if isinstance(packed, dict) else ():
        with contextlib.suppress(ValueError):  # malformed: `audit` names it
            n = packed_nbytes(state)
            own["rng"], total["rng"] = own.get("rng", 0) + n, total.get("rng", 0) + n
    noise = rec.get("noise", {})
    return {
        "version": m.version,
        "step": m.step,
        "parent": m.parent,
        "created": m.created,
        "writer": m.writer,
        # derived, never the stored flag (I7): audit reports a flag that disagrees
        "complete": m.step == _planned_steps(rec),
        **_epsilon(m),
        "delta": rec.get("accountant", {}).get("delta"),
        "threat_model": rec.get("threat_model", THREAT_MODEL_DEFAULT),
        "bytes_written": sum(own.values()),
        "bytes_total": sum(total.values()),
        "bytes_written_by_kind": dict(sorted(own.items())),
        "bytes_total_by_kind": dict(sorted(total.items())),
        "placement": placement(noise),
        "plan": noise.get("plan"),
        "history_bytes": noise.get("history_bytes"),
        "embedding": _embedding_summary(rec.get("embedding")),
        "metrics": _metrics_summary(m),
    }


def _epsilon(m: Manifest) -> dict[str, Any]:
    """`epsilon`: the version's stored epsilon, or for one written mid-run (which
    stores only its accounting event) the epsilon composed now from its config, as
    audit recomputes it (None: malformed records; audit says what is wrong).
    `epsilon_stored` says which."""
    rec = m.records
    acc = rec.get("accountant", {})
    stored = acc.get("epsilon") if isinstance(acc, dict) else None
    if stored is not None:
        return {"epsilon": stored, "epsilon_stored": True}
    try:
        if m.step == 0:
            return {"epsilon": 0.0, "epsilon_stored": False}
        from cocoon_ckpt.dp.accounting.amplified import epsilon_of_run  # dp-accounting: ~1 s

        eps = epsilon_of_run(
            rec["config"]["dp"], rec.get("mechanism"), m.step, str(acc.get("method", "pld"))
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return {"epsilon": None, "epsilon_stored": False}
    return {"epsilon": eps, "epsilon_stored": False}


def _metrics_summary(m: Manifest) -> dict[str, Any] | None:
    """Per metric: its points and its last one (None: a version without the record)."""
    if METRICS_RECORD not in m.records:
        return None
    try:
        curve = read_metrics(m.records[METRICS_RECORD], m.step, f"version {m.version}")
    except MetricsError as exc:
        return {"error": str(exc)}  # `audit` reports it as a finding
    return {
        name: {"points": len(s), "last_step": s.steps[-1], "last": s.values[-1]}
        for name, s in sorted(curve.items())
        if s.steps
    }


def _planned_steps(rec: dict[str, Any]) -> int | None:
    steps = rec.get("config", {}).get("dp", {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _embedding_summary(emb: EmbeddingRecord | None) -> dict[str, Any] | None:
    """Per version: how many tables take each noise path, hot rows, CSC size."""
    if emb is None:
        return None
    modes: dict[str, int] = {}
    hot = entries = csc_bytes = 0
    pre = 0.0
    for t in emb["tables"]:
        mode = t["plan"]["mode"]
        modes[mode] = modes.get(mode, 0) + 1
        if mode == "coalesced":
            hot += int(t["plan"]["hot"])
        csc = t.get("csc")
        if csc:
            entries += int(csc["entries"])
            csc_bytes += int(csc["bytes"])
        pre += float(t.get("precompute_seconds", 0.0))
    return {
        "threat_model": emb["threat_model"],
        "cursor": emb["cursor"],
        "tables": len(emb["tables"]),
        "modes": dict(sorted(modes.items())),
        "hot_rows": hot,
        "csc_entries": entries,
        "csc_bytes": csc_bytes,
        "precompute_seconds": pre,
    }


def inspect_store(
    url: str,
    *,
    version: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a store holds: its versions (step, sizes by kind, placement, threat model,
    epsilon), the job, the lease holder and where the key is. Reads manifests only.

    Args:
        url: store URL.
        version: describe only this version (with its full config and array list).
        storage_options: fsspec options.

    Raises:
        StoreNotFoundError: `url` holds no store.
        VersionNotFoundError: `version` does not exist.
    """
    store = Store.open(url, storage_options=storage_options, create=False)
    numbers = [version] if version is not None else store.versions()
    versions: list[dict[str, Any]] = []
    damaged: list[dict[str, Any]] = []
    last: Manifest | None = None
    for v in numbers:
        try:
            m = store.manifest(v)
        except CorruptVersionError as exc:
            if version is not None:
                raise
            damaged.append({"version": v, "error": str(exc)})
            continue
        versions.append(_version_summary(m))
        last = m
    out: dict[str, Any] = {
        "store": url,
        "format_version": store.attributes.get("format_version"),
        "created": store.attributes.get("created"),
        "versions": versions,
        "damaged_manifests": damaged,
        "lease_holder": store.lease_holder(),
        "key_in_store": store.get_secret(KEY_SECRET) is not None,
    }
    if version is None:
        space = store.space()
        out["space"] = {
            "data_bytes": space.data,
            "referenced_bytes": space.referenced,
            "unreachable_bytes": space.unreachable,
            "in_flight_bytes": space.in_flight,
            "unreferenced_shared_bytes": space.unreferenced_shared,
            "data_ratio": space.data_ratio,
            "unreadable_versions": list(space.unreadable),
        }
    if last is not None:
        rec = last.records
        dp = rec.get("config", {}).get("dp", {})
        out["job"] = {
            "job": rec.get("config", {}).get("job"),
            "fingerprint": rec.get("fingerprint"),
            "steps_total": dp.get("steps"),
            "bands": dp.get("bands"),
            "mechanism": rec.get("mechanism", {}).get("mechanism"),
            "noise_multiplier": dp.get("noise_multiplier"),
            "target_epsilon": dp.get("target_epsilon"),
            "accountant": dp.get("accountant", "pld"),
            "dim": rec.get("noise", {}).get("dim"),
            "key_location": rec.get("key_location"),
            # None: written before the record (a resume runs at its own count)
            "grad_threads": rec.get("grad_threads"),
            "threat_model": rec.get("threat_model", THREAT_MODEL_DEFAULT),
            "threat_model_means": THREAT_MODELS.get(
                rec.get("threat_model", THREAT_MODEL_DEFAULT), "unknown threat model"
            ),
        }
        try:
            acc = rec.get("accountant", {})
            # the recorded epsilon, or composed from the config where the version
            # stores only its event; audit recomputes it either way
            out["job"]["guarantee"] = describe(
                rec,
                steps_done=last.step,
                epsilon=versions[-1]["epsilon"],
                accounting_method=str(acc.get("method", "pld")),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            out["job"]["guarantee"] = None  # malformed records: `audit` says what is wrong
        if version is not None:
            out["config"] = rec.get("config")
            out["arrays"] = {
                name: {**meta.to_json(), "kind": array_kind(name), "nbytes": meta.nbytes}
                for name, meta in sorted(last.arrays.items())
            }
    return out


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def diff_versions(
    url: str, v1: int, v2: int, *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What changed from version v1 to v2: arrays added, removed, rewritten or shared
    (same path), and every record field that differs. Reads manifests only.

    Raises:
        VersionNotFoundError: either version does not exist.
    """
    store = Store.open(url, storage_options=storage_options, create=False)
    a, b = store.manifest(v1), store.manifest(v2)
    names = set(a.arrays) | set(b.arrays)
    added = sorted(n for n in names if n not in a.arrays)
    removed = sorted(n for n in names if n not in b.arrays)
    both = sorted(set(a.arrays) & set(b.arrays))
    shared = [n for n in both if a.arrays[n].path == b.arrays[n].path]
    changed = [n for n in both if a.arrays[n].checksum != b.arrays[n].checksum]
    rewritten_same = [
        n for n in both if n not in shared and a.arrays[n].checksum == b.arrays[n].checksum
    ]
    fa, fb = _flat(a.records), _flat(b.records)
    records = {
        k: {"from": fa.get(k), "to": fb.get(k)}
        for k in sorted(set(fa) | set(fb))
        if fa.get(k) != fb.get(k) and not k.startswith("optimizer.state")
    }
    return {
        "store": url,
        "from": {"version": v1, "step": a.step},
        "to": {"version": v2, "step": b.step},
        "arrays_added": added,
        "arrays_removed": removed,
        "arrays_changed": changed,
        "arrays_shared": shared,
        "arrays_rewritten_unchanged": rewritten_same,
        "bytes_added": sum(b.arrays[n].nbytes for n in added),
        "records_changed": records,
        "same_job": a.job_fingerprint == b.job_fingerprint,
    }


def _referenced_bytes(manifests: Iterable[Manifest]) -> int:
    paths: dict[str, int] = {}
    for m in manifests:
        for meta in m.arrays.values():
            paths[meta.path] = meta.nbytes
    return sum(paths.values())


def collect_garbage(
    url: str,
    *,
    keep: int,
    storage_options: dict[str, Any] | None = None,
    takeover: bool = False,
    discard_damaged: bool = False,
) -> dict[str, Any]:
    """Delete every version but the `keep` newest (and the newest valid one), and
    whatever no kept manifest references. Takes the writer lease, so it never races
    a running job.

    Args:
        discard_damaged: also delete versions whose manifest fails to verify, with every
            array only they reference (otherwise such a version stops gc, deleting nothing:
            its arrays may be what a repair needs).

    Raises:
        ValueError: keep < 2.
        LeaseHeldError: a job is writing to the store.
        CorruptVersionError: a manifest fails to verify and `discard_damaged` is off;
            nothing was deleted.
    """
    if keep < 2:
        raise ConfigError(f"--keep={keep} must be >= 2 (the newest two versions always stay)")
    store = Store.open(url, storage_options=storage_options, create=False)
    before = store.versions()

    def readable(vs: list[int]) -> list[Manifest]:
        out = []
        for v in vs:
            try:
                out.append(store.manifest(v))
            except CorruptVersionError:
                pass
        return out

    bytes_before = _referenced_bytes(readable(before))
    if not discard_damaged:
        # refused before the lease is taken: a refused gc writes nothing
        verified_manifests(store, before, OnDamage.STOP)
    store.acquire_lease(takeover=takeover)
    try:
        deleted = store.retain(keep_last=keep, discard_damaged=discard_damaged)
    finally:
        store.release_lease()
    after = store.versions()
    return {
        "store": url,
        "versions_before": before,
        "versions_kept": after,
        "deleted": deleted,
        "bytes_freed": bytes_before - _referenced_bytes(readable(after)),
    }
