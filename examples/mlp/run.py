"""A resumable private MLP job: kill it at any moment, run it again, it resumes exactly.

python examples/mlp/run.py [STORE]     (default runs/example-mlp.zarr)
"""

import sys

from cocoon_ckpt import DPConfig, JobConfig, export_model, run_job

store = sys.argv[1] if len(sys.argv) > 1 else "runs/example-mlp.zarr"
config = JobConfig(
    job="example:mlp",  # the model and data: cocoon_ckpt/examples/mlp.py; copy it for your own
    dp=DPConfig(steps=60, batch_size=32, dataset_size=2048, noise_multiplier=1.0, bands=8),
    checkpoint_every=10,
)
result = run_job(config, store)
print(
    f"{result.steps_done} steps, epsilon {result.epsilon:.3f}, resumed from {result.resumed_from}"
)
print(export_model(store, store.rstrip("/") + ".pt"))
