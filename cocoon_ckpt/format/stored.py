"""A committed version's parts read one by one: its typed records, the model, the
newest version's records (its config among them), the embedding plans. Trainer-free:
the tools read versions through this module (`tools.export`), the resume and the codec
too."""

from __future__ import annotations

from typing import Any, cast

import torch

from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.layout import MODEL_PREFIX
from cocoon_ckpt.records import VersionRecords
from state import Manifest, Store, StoreError, Version

__all__ = ["model_state", "newest_records", "records_of", "stored_table_plans"]


def records_of(version: Version | Manifest) -> VersionRecords:
    """A version's records, typed (the store keeps them as plain JSON)."""
    return cast(VersionRecords, version.records)


def model_state(version: Version) -> dict[str, torch.Tensor]:
    """The model state_dict held by a version (verified arrays, copied)."""
    return {
        name[len(MODEL_PREFIX) :]: torch.from_numpy(version.array(name).copy())
        for name in version.array_names()
        if name.startswith(MODEL_PREFIX)
    }


def stored_table_plans(version: Version) -> dict[str, TablePlan] | None:
    """The embedding plans a version recorded (a resume must keep them)."""
    emb = records_of(version).get("embedding")
    if emb is None:
        return None
    return {t["param"]: TablePlan.from_record(dict(t["plan"])) for t in emb["tables"]}


def newest_records(store_url: str, storage_options: dict[str, Any] | None = None) -> VersionRecords:
    """The records of a store's newest version (its config among them)."""
    store = Store.open(store_url, storage_options=storage_options, create=False)
    versions = store.versions()
    if not versions:
        raise StoreError(f"{store_url} has no committed version")
    return records_of(store.manifest(versions[-1]))
