"""Committing, crashing and comparing, as the conformance tests do it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import hooks
from ..store import Store

__all__ = ["InjectedCrash", "commit", "crash_after", "same"]


class InjectedCrash(Exception):
    """Raised at an armed crash point by these tests."""


def commit(store: Store, step: int, arrays: dict[str, np.ndarray], **records: object) -> int:
    """Commit one version of `arrays` and `records` on top of the newest; its number."""
    have = store.versions()
    txn = store.begin(step, parent=have[-1] if have else None)
    for name, arr in arrays.items():
        txn.put_array(name, arr)
    for name, rec in records.items():
        txn.put_record(name, rec)
    return txn.commit().version


def crash_after(hits: int, **match: Any) -> hooks.Handler:
    """A crash-point handler that lets `hits` matching calls pass, then raises
    InjectedCrash; a call matches when its context holds every `match` item."""
    remaining = [hits]

    def handler(name: str, ctx: Mapping[str, Any]) -> None:
        if any(ctx.get(k) != v for k, v in match.items()):
            return
        if remaining[0] == 0:
            raise InjectedCrash(name)
        remaining[0] -= 1

    return handler


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """The same dtype, shape and bytes."""
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
