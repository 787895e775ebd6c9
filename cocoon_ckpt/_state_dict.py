"""The `kind` / `schema_version` guard every stateful part's load_state_dict runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cocoon_ckpt.errors import StateSchemaError


def check_state(state: Mapping[str, Any], kind: str, schema_version: int) -> None:
    """Raise StateSchemaError unless `state` is a `kind` record of `schema_version`."""
    got_kind = state.get("kind")
    got_ver = state.get("schema_version")
    if got_kind != kind:
        raise StateSchemaError(f"expected a {kind} state_dict, got kind={got_kind!r}")
    if got_ver != schema_version:
        raise StateSchemaError(
            f"{kind} state_dict has schema_version={got_ver!r}; this library reads {schema_version}"
        )
