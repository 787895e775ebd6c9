from __future__ import annotations

from typing import Any

from cocoon_ckpt import DPConfig, JobConfig


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
