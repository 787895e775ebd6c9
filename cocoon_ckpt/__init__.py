"""cocoon_ckpt: BandMF correlated-noise DP training whose noise state is checkpointed
atomically, so a job can crash anywhere and resume with exactly the same noise."""

from typing import TYPE_CHECKING

from cocoon_ckpt._lazy import attach

if TYPE_CHECKING:  # the names as static tools see them
    from cocoon_ckpt._version import __version__ as __version__
    from cocoon_ckpt.dp.accounting.accountant import Accountant
    from cocoon_ckpt.dp.accounting.amplified import epsilon
    from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
    from cocoon_ckpt.dp.accounting.method import AccountingMethod
    from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
    from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
    from cocoon_ckpt.dp.noise import BLOCK, GENERATOR_BACKEND, KeyedNoise
    from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
    from cocoon_ckpt.errors import (
        CocoonError,
        ConfigMismatchError,
        GeneratorMismatchError,
        NoiseKeyError,
        PrivacyBudgetError,
        StateSchemaError,
        UnsupportedModelError,
    )
    from cocoon_ckpt.tools.export import export_model
    from cocoon_ckpt.train.allowances import ResumeAllowances
    from cocoon_ckpt.train.checkpoint import Checkpointer
    from cocoon_ckpt.train.config import DPConfig, JobConfig
    from cocoon_ckpt.train.options import JobOptions
    from cocoon_ckpt.train.parts import JobParts
    from cocoon_ckpt.train.runner import RunResult, run_job
    from cocoon_ckpt.train.session import JobSession, open_job
    from cocoon_ckpt.train.trainer import DPTrainer, StepResult

# Names load on first use (PEP 562): `cocoon-ckpt inspect` and the other store-only
# commands never import torch or dp-accounting, and start in a fraction of a second.
_LAZY = {
    "__version__": "_version",  # pyproject's version, from the installed metadata
    "Accountant": "dp.accounting.accountant",
    "AccountingMethod": "dp.accounting.method",
    "BLOCK": "dp.noise",
    "BandMF": "dp.mechanism",
    "BandMFNoise": "dp.bandmf_noise",
    "Checkpointer": "train.checkpoint",
    "CocoonError": "errors",
    "ConfigMismatchError": "errors",
    "CyclicPoissonSampler": "dp.sampler",
    "DPConfig": "train.config",
    "DPTrainer": "train.trainer",
    "GENERATOR_BACKEND": "dp.noise",
    "GeneratorMismatchError": "errors",
    "JobConfig": "train.config",
    "JobOptions": "train.options",
    "JobParts": "train.parts",
    "JobSession": "train.session",
    "KeyedNoise": "dp.noise",
    "MechanismKind": "dp.mechanism",
    "NoiseKeyError": "errors",
    "PrivacyBudgetError": "errors",
    "ResumeAllowances": "train.allowances",
    "RunResult": "train.runner",
    "StateSchemaError": "errors",
    "StepResult": "train.trainer",
    "UnsupportedModelError": "errors",
    "epsilon": "dp.accounting.amplified",
    "export_model": "tools.export",
    "noise_multiplier_for": "dp.accounting.calibration",
    "open_job": "train.session",
    "run_job": "train.runner",
}


__getattr__, __dir__ = attach(__name__, _LAZY)


__all__ = [
    "BLOCK",
    "GENERATOR_BACKEND",
    "Accountant",
    "AccountingMethod",
    "BandMF",
    "BandMFNoise",
    "Checkpointer",
    "CocoonError",
    "ConfigMismatchError",
    "CyclicPoissonSampler",
    "DPConfig",
    "DPTrainer",
    "GeneratorMismatchError",
    "JobConfig",
    "JobOptions",
    "JobParts",
    "JobSession",
    "KeyedNoise",
    "MechanismKind",
    "NoiseKeyError",
    "PrivacyBudgetError",
    "ResumeAllowances",
    "RunResult",
    "StateSchemaError",
    "StepResult",
    "UnsupportedModelError",
    "epsilon",
    "export_model",
    "noise_multiplier_for",
    "open_job",
    "run_job",
]
