"""A coalesced job reading its CSC in windows (`csc_window_steps`), resumed: the
resume's verification streams the CSC's `rows` and `values` (`state.version.
verify_streamed`) and nothing reads them whole, so its memory stays bounded by a
window (issue #32 item 3); the resumed job ends on the uninterrupted job's model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import state.version
from cocoon_ckpt import JobConfig, run_job
from cocoon_ckpt.embedding.csc_window import read_in_windows
from cocoon_ckpt.train.options import JobOptions
from state import Store, Version
from tests.cocoon_ckpt.test_csc_window import _config as whole_job_config
from tests.cocoon_ckpt.test_csc_window import _model


def _config(window: int | None = 3) -> JobConfig:
    """test_csc_window's small DLRM job, 10 steps."""
    return whole_job_config(window, steps=10)


def _is_csc_data(name: str) -> bool:
    return "/csc/" in name and name.rsplit("/", 1)[-1] in ("rows", "values")


def test_a_windowed_job_resumed_never_reads_its_csc_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CSC's rows and values are streamed on verification however small (the resume
    names them: `read_in_windows`), and no whole read (`Version.array`, `read_array`) touches the CSC's rows or values
    during the resume, while they are verified and the job ends bit-exact."""
    opts = JobOptions(key_file=str(tmp_path / "k"))
    run_job(_config(), str(tmp_path / "once"), options=opts)
    store = tmp_path / "resumed"
    run_job(_config(), str(store), options=opts, stop_after=6)

    asked: list[str] = []
    whole: list[str] = []
    streamed: list[str] = []
    real_array, real_read = Version.array, state.version.read_array
    real_stream = state.version.verify_array

    def array(self: Version, name: str) -> Any:
        asked.append(name)
        return real_array(self, name)

    def read(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        whole.append(name)
        return real_read(backend, group, name, *a, **k)

    def stream(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        streamed.append(name)
        return real_stream(backend, group, name, *a, **k)

    monkeypatch.setattr(Version, "array", array)
    monkeypatch.setattr(state.version, "read_array", read)
    monkeypatch.setattr(state.version, "verify_array", stream)
    run_job(_config(), str(store), options=opts)

    # an empty CSC (a table all hot) is nothing to read: only the others are watched
    resumed = Store.open(str(store), create=False)
    arrays = resumed.manifest(resumed.versions()[-1]).arrays
    watched = {n.split("/csc/")[0] for n, m in arrays.items() if _is_csc_data(n) and m.shape[0]}
    assert len(watched) >= 2, sorted(arrays)

    def of_watched(names: list[str]) -> list[str]:
        return [
            n for n in names if _is_csc_data(n) and n.split("/csc/")[0].endswith(tuple(watched))
        ]

    assert len(set(of_watched(streamed))) == 2 * len(watched), streamed  # verified on resume
    assert any(n.endswith("/csc/col_ptr") for n in asked), asked  # the spies see reads
    assert not of_watched(asked + whole), (asked, whole)
    want, got = _model(tmp_path / "once"), _model(store)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_job_reading_its_csc_whole_reads_each_array_once_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without windows the resume names nothing to stream: each array is read once,
    verified and kept for the restore, however large (`STREAM_BYTES` 0 here), instead of
    checked by a streamed pass and read again."""
    opts = JobOptions(key_file=str(tmp_path / "k"))
    store = tmp_path / "s"
    run_job(_config(None), str(store), options=opts, stop_after=6)
    monkeypatch.setattr(state.version, "STREAM_BYTES", 0)
    streamed: list[str] = []
    real_stream = state.version.verify_array

    def stream(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        streamed.append(name)
        return real_stream(backend, group, name, *a, **k)

    monkeypatch.setattr(state.version, "verify_array", stream)
    run_job(_config(None), str(store), options=opts)
    assert streamed == []
    assert Store.open(str(store), create=False).latest() is not None


@pytest.mark.parametrize(
    ("name", "windowed"),
    [
        ("emb/t0/csc/rows", True),
        ("emb/t0/csc/values", True),
        ("emb/t0/csc/col_ptr", False),
        ("emb/t0/csc/slots-0-64/rows", True),
        ("emb/t0/csc/slots-0-64/col_ptr", False),
        ("emb/t0/hot/rows", False),
        ("model/csc/rows", False),
        ("rows", False),
    ],
)
def test_the_arrays_read_in_windows_are_a_cscs_rows_and_values(name: str, windowed: bool) -> None:
    assert read_in_windows(name) is windowed
