"""Running a job: the config, the parts a job builder returns, the DP trainer, the
snapshot codec and checkpointer, resume checks, `run_job`, preemption and distributed."""
