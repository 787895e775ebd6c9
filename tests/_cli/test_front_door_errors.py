"""The errors a new user meets first: one line that names what they typed and the fix,
the exit code of its kind (2: a malformed request), and nothing written.

Each case runs `cocoon-ckpt` in-process from a folder holding the user's job file
(`--job NAME:FUNCTION`), with the store and the key file in another folder whose tree is
hashed before and after.
"""

from __future__ import annotations

import hashlib
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cocoon_ckpt import DPConfig
from cocoon_ckpt._cli.exits import FAILURE
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.errors import ConfigError

SMALL = (
    *("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress"),
    *("--dataset-size", "256", "--batch-size", "16"),
)

#: The user's job file: the example MLP, a builder that fails, and Datasets of dicts and
#: of a failing __getitem__. LINE_* name the lines the errors must point at.
JOB = """
import torch
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts


def build(config):
    return mlp.build(config)


def boom(config):
    raise RuntimeError("the user's bug")  # LINE_BOOM


class Items(torch.utils.data.Dataset):
    def __init__(self, n, dicts):
        self.x, self.y = mlp.make_data(n, 20, 4, 0)
        self.dicts = dicts

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.dicts is None:
            raise KeyError(f"no record {i}")  # LINE_GETITEM
        return {"x": self.x[i], "y": self.y[i]}


def _with(config, dicts):
    parts = mlp.build(config)
    return JobParts(model=parts.model, optimizer=parts.optimizer, loss_fn=parts.loss_fn,
                    dataset=Items(config.dp.dataset_size, dicts))


def dicts(config):
    return _with(config, True)


def broken(config):
    return _with(config, None)
"""


def _line(tag: str) -> int:
    return next(i for i, text in enumerate(JOB.splitlines(), 1) if tag in text)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh job module in tmp_path/jobs, the current directory (not on sys.path, as
    for the console script)."""
    name = f"err_jobs_{uuid.uuid4().hex[:10]}"
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / f"{name}.py").write_text(JOB)
    monkeypatch.chdir(tmp_path / "jobs")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """The folder of the store and of the key file's folder (`keys/`)."""
    (tmp_path / "out" / "keys").mkdir(parents=True)
    return tmp_path / "out"


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p.relative_to(root))] = f"{p.lstat().st_mode:o}:{digest}"
    return out


def _refused(capsys: pytest.CaptureFixture[str], out: Path, code: int, *argv: str) -> str:
    """Run `cocoon-ckpt ARGV`: exit `code`, one line on stderr, nothing on stdout, and
    `out` as it was. Returns the line."""
    before = _tree(out)
    capsys.readouterr()
    assert main(list(argv)) == code
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1 and err.startswith("cocoon-ckpt: error: "), err
    assert _tree(out) == before
    return err


def _train(job: str, out: Path, *more: str) -> tuple[str, ...]:
    store, key = str(out / "s.zarr"), str(out / "keys" / "k")
    return ("train", "--job", job, "--store", store, "--key-file", key, *SMALL, *more)


def test_an_unknown_url_scheme_names_the_argument_and_the_known_schemes(
    capsys: pytest.CaptureFixture[str], out: Path
) -> None:
    err = _refused(capsys, out, 2, "export", "s4://bucket/run.zarr", "--out", str(out / "m.pt"))
    assert "URL s4://bucket/run.zarr: no storage knows the URL scheme 's4'" in err
    assert re.search(r"\bs3, s3a\b", err) and " memory, " in err and " file, " in err
    err = _refused(capsys, out, 2, "train", "--store", "s4://bucket/run.zarr", *SMALL)
    assert "--store s4://bucket/run.zarr: no storage knows the URL scheme 's4'" in err


def test_an_exception_in_the_users_builder_names_their_file_and_line(
    capsys: pytest.CaptureFixture[str], job: str, out: Path
) -> None:
    err = _refused(capsys, out, FAILURE, *_train(f"{job}:boom", out))
    file = Path.cwd() / f"{job}.py"
    assert f"RuntimeError: the user's bug (at {file}:{_line('LINE_BOOM')} in boom;" in err


def test_an_exception_in_the_users_dataset_names_their_file_and_line(
    capsys: pytest.CaptureFixture[str], job: str, out: Path
) -> None:
    err = _refused(capsys, out, FAILURE, *_train(f"{job}:broken", out))
    file = Path.cwd() / f"{job}.py"
    assert "KeyError: 'no record" in err
    assert f"(at {file}:{_line('LINE_GETITEM')} in __getitem__;" in err


def test_a_dataset_of_dicts_is_refused_naming_what_it_must_return(
    capsys: pytest.CaptureFixture[str], job: str, out: Path
) -> None:
    err = _refused(capsys, out, 2, *_train(f"{job}:dicts", out))
    assert "the job's dataset (Items)" in err and "got dict" in err
    assert "make the Dataset's items tuples of tensors" in err


def test_lbfgs_is_refused_at_start_naming_the_flag(
    capsys: pytest.CaptureFixture[str], out: Path
) -> None:
    store = str(out / "s.zarr")
    err = _refused(capsys, out, 2, "train", "--store", store, "--optimizer", "lbfgs", *SMALL)
    assert err.startswith("cocoon-ckpt: error: --optimizer lbfgs: LBFGS.step() needs closure")
    assert "use an optimizer whose step() needs no argument" in err


def test_a_py_file_in_job_gives_the_module_name_meant(
    capsys: pytest.CaptureFixture[str], job: str, out: Path
) -> None:
    err = _refused(capsys, out, 2, *_train(f"{job}.py:build", out))
    assert f"name its module instead: {job}:build, run from the folder of {job}.py" in err
    err = _refused(capsys, out, 2, *_train(f"sub/{job}.py:build", out))
    assert f"{job}:build, run from the folder sub, which holds {job}.py" in err


def test_long_options_are_never_abbreviated(capsys: pytest.CaptureFixture[str], out: Path) -> None:
    store = str(out / "s.zarr")
    err = _refused(capsys, out, 2, "train", "--store", store, "--target-eps", "3", *SMALL)
    assert "unrecognized arguments: --target-eps 3" in err
    err = _refused(capsys, out, 2, "train", "--sto", store, *SMALL)
    assert "unrecognized arguments: --sto" in err


def test_config_refusals_name_the_flags_on_the_command_line(
    capsys: pytest.CaptureFixture[str], out: Path
) -> None:
    store = str(out / "s.zarr")
    err = _refused(capsys, out, 2, "train", "--store", store, "--bands", "8", "--steps", "4")
    assert err == "cocoon-ckpt: error: --bands 8 must be <= --steps 4\n"
    err = _refused(capsys, out, 2, "train", "--store", store, "--lease-expiry", "1")
    assert err.startswith("cocoon-ckpt: error: --lease-expiry 1.0 must be at least 5 seconds:")


def test_the_python_api_keeps_the_field_names() -> None:
    with pytest.raises(ConfigError, match=r"^Expected DPConfig\.bands=8 to be <= steps=4$"):
        DPConfig(steps=4, bands=8, batch_size=1, dataset_size=64, noise_multiplier=1.0)


def test_a_flag_refusal_comes_before_the_users_job_is_imported(
    capsys: pytest.CaptureFixture[str], job: str, out: Path
) -> None:
    err = _refused(capsys, out, 2, *_train(f"{job}:build", out), "--bands", "99")
    assert err == "cocoon-ckpt: error: --bands 99 must be <= --steps 4\n"
    assert job not in sys.modules


def test_a_key_file_in_a_missing_folder_is_refused_before_the_store(
    capsys: pytest.CaptureFixture[str], out: Path
) -> None:
    store, key = str(out / "s.zarr"), str(out / "gone" / "k")
    err = _refused(capsys, out, 2, "train", "--store", store, "--key-file", key, *SMALL)
    assert f"--key-file {key}: its folder {out / 'gone'} does not exist" in err
