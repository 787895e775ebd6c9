"""The optimizer's codec: torch's optimizer state_dict, its tensors as arrays
`optim/<param index>/<key>` (`layout.optim_name`), everything else in the record."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cocoon_ckpt.format.snapshot import Encoded, host_copy
from cocoon_ckpt.layout import optim_name
from cocoon_ckpt.records import OptimizerRecord, OptimizerValue
from state import Version

__all__ = ["decode", "encode"]


def encode(opt: dict[str, Any]) -> Encoded[OptimizerRecord]:
    """The record of `opt` (torch's `Optimizer.state_dict()`) and its tensors' copies."""
    arrays: dict[str, np.ndarray] = {}
    state: dict[str, dict[str, OptimizerValue]] = {}
    for idx, st in opt["state"].items():
        rec: dict[str, OptimizerValue] = {}
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                arrays[optim_name(idx, key)] = host_copy(val)
                rec[key] = {"array": optim_name(idx, key)}
            else:
                rec[key] = {"value": val}
        state[str(idx)] = rec
    return Encoded(record={"param_groups": opt["param_groups"], "state": state}, arrays=arrays)


def decode(rec: OptimizerRecord, version: Version) -> dict[str, Any]:
    """The optimizer state_dict `rec` records, its tensors read from `version`."""
    state: dict[int, dict[str, Any]] = {}
    for idx, st in rec["state"].items():
        state[int(idx)] = {
            key: torch.from_numpy(version.array(v["array"]).copy()) if "array" in v else v["value"]
            for key, v in st.items()
        }
    return {"param_groups": rec["param_groups"], "state": state}
