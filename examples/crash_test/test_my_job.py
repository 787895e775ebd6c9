"""A crash test for your own job, with the cocoon-ckpt pytest plugin's fixtures.

Copy this file, point `config.job` at your `module:function`, and run pytest.
"""

from cocoon_ckpt import DPConfig, JobConfig, JobOptions
from fault_injection import verify

config = JobConfig(
    job="example:mlp",  # your job: "mypackage.jobs:build" returning JobParts
    dp=DPConfig(steps=30, batch_size=16, dataset_size=512, noise_multiplier=1.0, bands=8),
    checkpoint_every=5,
)


def test_my_job_resumes_with_exactly_the_same_noise(
    golden_run, crash_schedule, faulty_store, noise_key_file
):
    reference = golden_run(config)
    url, fs = faulty_store(seed=1, transient=0.1, lost_response=0.05)
    options = JobOptions(fs=fs, key_file=noise_key_file)
    trace, divergence = verify(config, url, crash_schedule(config, n=3), reference, options=options)
    assert divergence is None, str(divergence)
    assert trace.crashes  # the schedule really crashed the job
