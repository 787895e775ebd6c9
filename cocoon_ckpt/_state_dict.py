"""State dicts: the `kind` / `schema_version` guard every stateful part's
load_state_dict runs, and model state as the plain (uncompiled) module names it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from cocoon_ckpt.errors import ConfigError, StateSchemaError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["COMPILED_PREFIX", "check_state", "plain_keys", "uncompiled"]

#: What `torch.compile(model)` puts before every parameter and buffer name: the
#: OptimizedModule it returns holds the model as its submodule `_orig_mod`.
COMPILED_PREFIX = "_orig_mod."

_V = TypeVar("_V")


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


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a `torch.compile`d model wraps (`model` itself when not compiled).

    Its parameter and state-dict names lack the `_orig_mod.` prefix, so a store written
    with a compiled model resumes with the plain one and vice versa, and an export loads
    into the plain model. It shares the compiled model's parameters.
    """
    # torch.compile imports this module, so an OptimizedModule cannot exist before it is
    # imported; importing it here would add torch._dynamo to every job's start (2.2 s
    # measured on CPU, torch 2.13)
    frames = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(frames, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def plain_keys(state: Mapping[str, _V], where: str) -> dict[str, _V]:
    """`state` with the leading `_orig_mod.` prefixes a compiled model's names carry
    removed (stores written before `uncompiled` normalised them); `where` names the
    state in errors.

    Raises:
        ConfigError: two keys become one (a key and its prefixed twin).
    """
    out: dict[str, _V] = {}
    for key, value in state.items():
        plain = key
        while plain.startswith(COMPILED_PREFIX):
            plain = plain[len(COMPILED_PREFIX) :]
        if plain in out:
            raise ConfigError(
                f"{where}: keys {key!r} and {plain!r} are one parameter once the "
                f"torch.compile prefix {COMPILED_PREFIX!r} is removed; the state holds "
                "both, so it is not one model's: export it from a store of one model"
            )
        out[plain] = value
    return out
