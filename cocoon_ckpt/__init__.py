"""cocoon_ckpt: BandMF correlated-noise DP training whose noise state is checkpointed
atomically, so a job can crash anywhere and resume with exactly the same noise."""

from typing import TYPE_CHECKING

from ._lazy import attach

if TYPE_CHECKING:  # the names as static tools see them
    from ._version import __version__ as __version__
    from .accountant import Accountant, AccountingMethod, epsilon, noise_multiplier_for
    from .checkpoint import Checkpointer
    from .config import DPConfig, JobConfig
    from .errors import (
        CocoonError,
        ConfigMismatchError,
        GeneratorMismatchError,
        NoiseKeyError,
        PrivacyBudgetError,
        StateSchemaError,
        UnsupportedModelError,
    )
    from .job import RunResult, export_model, run_job
    from .jobs import JobParts
    from .mechanism import BandMF, MechanismKind
    from .noise import BLOCK, GENERATOR_BACKEND, CorrelatedNoise, KeyedNoise
    from .sampler import CyclicPoissonSampler
    from .trainer import DPTrainer, StepResult

# Names load on first use (PEP 562): `cocoon-ckpt inspect` and the other store-only
# commands never import torch or dp-accounting, and start in a fraction of a second.
_LAZY = {
    "__version__": "_version",  # pyproject's version, from the installed metadata
    "Accountant": "accountant",
    "AccountingMethod": "accountant",
    "BLOCK": "noise",
    "BandMF": "mechanism",
    "Checkpointer": "checkpoint",
    "CocoonError": "errors",
    "ConfigMismatchError": "errors",
    "CorrelatedNoise": "noise",
    "CyclicPoissonSampler": "sampler",
    "DPConfig": "config",
    "DPTrainer": "trainer",
    "GENERATOR_BACKEND": "noise",
    "GeneratorMismatchError": "errors",
    "JobConfig": "config",
    "JobParts": "jobs",
    "KeyedNoise": "noise",
    "MechanismKind": "mechanism",
    "NoiseKeyError": "errors",
    "PrivacyBudgetError": "errors",
    "RunResult": "job",
    "StateSchemaError": "errors",
    "StepResult": "trainer",
    "UnsupportedModelError": "errors",
    "epsilon": "accountant",
    "export_model": "job",
    "noise_multiplier_for": "accountant",
    "run_job": "job",
}


__getattr__, __dir__ = attach(__name__, _LAZY)


__all__ = [
    "BLOCK",
    "GENERATOR_BACKEND",
    "Accountant",
    "AccountingMethod",
    "BandMF",
    "Checkpointer",
    "CocoonError",
    "ConfigMismatchError",
    "CorrelatedNoise",
    "CyclicPoissonSampler",
    "DPConfig",
    "DPTrainer",
    "GeneratorMismatchError",
    "JobConfig",
    "JobParts",
    "KeyedNoise",
    "MechanismKind",
    "NoiseKeyError",
    "PrivacyBudgetError",
    "RunResult",
    "StateSchemaError",
    "StepResult",
    "UnsupportedModelError",
    "epsilon",
    "export_model",
    "noise_multiplier_for",
    "run_job",
]
