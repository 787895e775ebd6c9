"""The model's codec: its state_dict, one array per entry (`layout.model_name`)."""

from __future__ import annotations

import torch

from cocoon_ckpt.format.snapshot import Encoded, host_copy
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.layout import model_name
from state import Version

__all__ = ["decode", "encode"]


def encode(model: dict[str, torch.Tensor]) -> Encoded[None]:
    """The model's arrays (it has no record: the arrays' names are its keys)."""
    return Encoded(record=None, arrays={model_name(k): host_copy(t) for k, t in model.items()})


def decode(version: Version) -> dict[str, torch.Tensor]:
    """The model state_dict a version holds (verified arrays, copied)."""
    return model_state(version)
