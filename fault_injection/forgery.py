"""Record forgeries as a writer of the store who lacks the job's key would make them:
edit a manifest, then recompute its unkeyed checksums (`state.restamp`). Two kinds:
the stored MACs kept as they were (now stale), or stripped (the version then looks
like one written before store format 4). Either must be refused wherever the key is
at hand."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from state import Store, restamp
from state.paths import manifest_path

__all__ = ["forge_manifest", "forge_random_number"]

Edit = Callable[[dict[str, Any]], str]


def forge_manifest(store: Store, version: int, edit: Edit, *, keep_macs: bool) -> str:
    """Apply `edit` (which changes the parsed manifest in place and says what it did)
    to version `version`'s manifest and write it back with fresh checksums, its MACs
    kept (stale) or stripped. Returns what `edit` said."""
    path = manifest_path(version)
    doc: dict[str, Any] = json.loads(store.backend.read_bytes(path))
    what = edit(doc)
    store.backend.fs.pipe_file(store.backend.path(path), restamp(doc, keep_macs=keep_macs))
    return what


def _numbers(value: Any, where: str) -> list[tuple[str, Any, Any]]:
    """(where, container, key) of every int or float leaf (bools excepted)."""
    out: list[tuple[str, Any, Any]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, v in items:
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out.append((f"{where}.{k}", value, k))
        elif isinstance(v, (dict, list)):
            out.extend(_numbers(v, f"{where}.{k}"))
    return out


def forge_random_number(rng: random.Random) -> Edit:
    """An edit that doubles one number of one record (or adds one to the header's step,
    where no record holds a number): a sigma, a step count, a clip norm, a seed."""

    def edit(doc: dict[str, Any]) -> str:
        leaves = _numbers(doc["records"], "records")
        if not leaves:
            doc["step"] += 1
            return f"step -> {doc['step']}"
        where, container, key = rng.choice(leaves)
        old = container[key]
        container[key] = old * 2 if old else 1
        return f"{where}: {old!r} -> {container[key]!r}"

    return edit
