"""A resumable private DLRM job (dense MLP + Zipf-accessed embedding tables).

python examples/dlrm/run.py [STORE]    (default runs/example-dlrm.zarr)
"""

import sys

from cocoon_ckpt import DPConfig, JobConfig, export_model, run_job

store = sys.argv[1] if len(sys.argv) > 1 else "runs/example-dlrm.zarr"
config = JobConfig(
    job="example:dlrm",  # cocoon_ckpt/examples/dlrm.py: 4 tables, Zipf 1.1 ids
    dp=DPConfig(steps=60, batch_size=64, dataset_size=4096, noise_multiplier=1.0, bands=8),
    options={"tables": [2000, 1000, 500, 100], "dim": 8},
    checkpoint_every=10,
)
result = run_job(config, store)
print(
    f"{result.steps_done} steps, epsilon {result.epsilon:.3f}, resumed from {result.resumed_from}"
)
print(export_model(store, store.rstrip("/") + ".pt"))
