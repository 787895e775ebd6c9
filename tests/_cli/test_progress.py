"""The train bar shows the epsilon the run will have spent at its end, composed once off
the training thread (mid-run versions no longer store theirs)."""

from __future__ import annotations

import threading
from pathlib import Path

from cocoon_ckpt import DPConfig, JobConfig, open_job
from cocoon_ckpt._cli.progress import Progress
from cocoon_ckpt.dp.accounting.accountant import Accountant
from cocoon_ckpt.examples import mlp


def test_the_bar_shows_the_runs_epsilon_at_its_end(tmp_path: Path) -> None:
    dp = DPConfig(steps=16, batch_size=16, dataset_size=512, noise_multiplier=1.0, bands=4)
    cfg = JobConfig(job="example:mlp", dp=dp, checkpoint_every=5)
    bar = Progress(16, 5, mode="bar")
    with open_job(cfg, str(tmp_path / "s.zarr"), mlp.build(cfg)) as job:
        for res in job.steps(until=3):
            bar.on_step(res, job.trainer)
        for t in threading.enumerate():
            if t.name == "progress-epsilon":
                t.join(120)
        whole = Accountant.from_state_dict(job.trainer.accountant.state_dict(with_epsilon=False))
        assert whole.steps == 3
        whole.steps = 16
        assert bar._shown["eps"] == f"{whole.epsilon():.3f}"
        assert [t.name for t in threading.enumerate()].count("progress-epsilon") == 0
    bar.close()
