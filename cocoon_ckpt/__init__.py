"""cocoon_ckpt: BandMF correlated-noise DP training whose noise state is checkpointed
atomically, so a job can crash anywhere and resume with exactly the same noise."""

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
