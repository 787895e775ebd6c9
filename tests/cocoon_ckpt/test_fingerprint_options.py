"""The job's options in the fingerprint: each option is the job's, whatever its name or
shape, and a resume that changes one is told which."""

from __future__ import annotations

from typing import Any

from cocoon_ckpt.train.config import DPConfig, JobConfig, config_differences, fingerprint


def _record(options: dict[str, Any]) -> dict[str, Any]:
    dp = DPConfig(steps=4, batch_size=2, dataset_size=64, noise_multiplier=1.0)
    return JobConfig(job="example:mlp", dp=dp, options=options).to_record()


def test_an_option_named_like_a_harmless_field_is_still_fingerprinted() -> None:
    a, b = _record({"keep_last": 1}), _record({"keep_last": 2})
    assert fingerprint(a, {}) != fingerprint(b, {})
    assert config_differences(a, b) == ["options.keep_last: stored 1, now 2"]


def test_nested_options_are_compared_whole() -> None:
    assert config_differences(_record({"x": {}}), _record({})) == [
        "options.x: stored '{}', now '<absent>'"
    ]
    flat, nested = _record({"a.b": 1}), _record({"a": {"b": 1}})
    assert fingerprint(flat, {}) != fingerprint(nested, {})
    assert config_differences(flat, nested) != []


def test_one_and_true_differ_and_the_difference_is_listed() -> None:
    a, b = _record({"x": 1}), _record({"x": True})
    assert fingerprint(a, {}) != fingerprint(b, {})
    assert config_differences(a, b) == ["options.x: stored 1, now True"]


def test_a_scalar_option_keeps_the_fingerprint_older_stores_hold() -> None:
    # computed by the fingerprint before options became leaves (commit 0ed911f): a store
    # written then with a scalar option still resumes
    rec = _record({"hidden": 8})
    assert fingerprint(rec, {}) == (
        "24ecb852848e894dda13e00c3e70ac98a42faf7655b01a0a12f60d75d711f147"
    )
    assert config_differences(rec, _record({"hidden": 16})) == ["options.hidden: stored 8, now 16"]
