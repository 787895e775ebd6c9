"""The column-normalized mechanism through the real noise step and the trainer: the
streamed noise is C^-1 z for the column-normalized C, and a config asking for it gets it."""

from __future__ import annotations

import pytest
import torch

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.trainer import build_mechanism

KEY = bytes(range(32))


@pytest.mark.parametrize(("bands", "steps"), [(4, 20), (8, 40), (2, 9)])
def test_streamed_noise_equals_the_dense_solve(bands: int, steps: int) -> None:
    m = BandMF.optimized_colnorm(bands, steps)
    cn = BandMFNoise(m, 37, KEY, 1.0, "float64")
    want = cn.materialize(steps)
    got = torch.stack([cn.step() for _ in range(steps)])
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    # the tail is where the two kinds part: the last b-1 steps are scaled down
    plain = BandMFNoise(BandMF.optimized(bands, steps), 37, KEY, 1.0, "float64")
    ref = torch.stack([plain.step() for _ in range(steps)])
    assert torch.equal(got[: steps - bands + 1], ref[: steps - bands + 1])
    assert not torch.equal(got[-1], ref[-1])


@pytest.mark.parametrize("kind", [k for k in MechanismKind if k is not MechanismKind.CUSTOM])
def test_a_config_asking_for_a_kind_trains_with_it(kind: MechanismKind) -> None:
    dp = DPConfig(
        steps=12, batch_size=2, dataset_size=64, noise_multiplier=1.0, bands=4, mechanism=kind
    )
    assert build_mechanism(dp).kind is kind


def test_a_config_cannot_ask_for_custom_coefficients() -> None:
    with pytest.raises(ConfigError, match="DPConfig.mechanism"):
        DPConfig(steps=12, batch_size=2, dataset_size=64, noise_multiplier=1.0, mechanism="custom")
