from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.keys import manifest_mac_key
from state import restamp


def reseal(doc: Mapping[str, Any], key: str | Path) -> bytes:
    """`doc` (an edited manifest) with fresh checksums and MACs under the job's key file
    or store `key` (a store's own key is read from its `secret/noise.key`): what a
    writer who holds the key (a bug, or its holder) could store, for the tests of the
    checks that run behind the MACs. A writer without the key is `state.restamp`."""
    path = Path(key)
    raw = (path / "secret" / "noise.key").read_bytes() if path.is_dir() else path.read_bytes()
    return restamp(doc, mac_key=manifest_mac_key(raw))


def job_config(example: str = "mlp", bands: int = 8, steps: int = 24, **kw: Any) -> JobConfig:
    dp = DPConfig(
        steps=steps,
        batch_size=16,
        dataset_size=512,
        noise_multiplier=1.0,
        bands=bands,
        seed=kw.pop("seed", 0),
    )
    opts = {"tables": [200, 100, 50], "dim": 4} if example == "dlrm" else {}
    return JobConfig(job=f"example:{example}", dp=dp, options=opts, checkpoint_every=5, **kw)


def tree(root: Path) -> dict[str, str]:
    """Every path under `root` with its mode and (files) a sha256 of its bytes: a
    refusal that 'writes nothing' leaves this equal."""
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = f"{p.lstat().st_mode:o}:{digest}"
    return out
