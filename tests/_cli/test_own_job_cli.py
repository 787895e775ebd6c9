"""`train --job mod:fn` beside the user, `--job-option`, and audit importing only a job
the user names on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import cocoon_ckpt
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.export import read_config
from cocoon_ckpt.train.parts import resolve

SMALL = (
    *("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress"),
    *("--dataset-size", "256", "--batch-size", "16"),
)

#: A user's job file: the example MLP, sized by its options; importing it leaves a mark
#: (a file named by MARK_ENV), so a test can tell whether anything imported it.
OWN_JOB = """
import os
from pathlib import Path

from cocoon_ckpt.examples import mlp

if os.environ.get("MARK_ENV"):
    Path(os.environ["MARK_ENV"]).write_text("imported")

SEEN = []

def build(config):
    SEEN.append(dict(config.options))
    return mlp.build(config)
"""


@pytest.fixture
def own_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a fresh job module in tmp_path, which becomes the current directory
    and, as for the console script, is not on sys.path."""
    name = f"ownjob_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(OWN_JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("cocoon-ckpt: error: "), err
    return err


def test_console_entry_finds_the_job_in_the_current_directory(tmp_path: Path) -> None:
    # -P: sys.path without the current directory, as the installed console script has;
    # the package itself is found as an installed one would be (PYTHONPATH)
    (tmp_path / "myjob.py").write_text(OWN_JOB)
    installed = str(Path(cocoon_ckpt.__file__).parent.parent)
    cmd = [sys.executable, "-P", "-m", "cocoon_ckpt", "train", "--job", "myjob:build"]
    done = subprocess.run(
        [*cmd, "--store", "s.zarr", *SMALL, "--job-option", "hidden=8", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MARK_ENV": "", "PYTHONPATH": installed},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 4
    assert read_config(str(tmp_path / "s.zarr")).options == {"hidden": 8}


def test_train_own_job_in_process_leaves_sys_path_as_it_was(own_job: str) -> None:
    before = list(sys.path)
    assert main(["train", "--job", f"{own_job}:build", "--store", "s.zarr", *SMALL]) == 0
    assert sys.path == before
    assert read_config("s.zarr").job == f"{own_job}:build"


@pytest.mark.parametrize(
    ("job", "needles"),
    [
        (
            "nosuchjob:build",
            ("cannot import module 'nosuchjob'", "run from the folder", "nosuchjob.py"),
        ),
        ("{own}:buidl", ("has no function 'buidl'", "build")),
        ("{own}", ("be 'example:NAME' or 'module:function'",)),
    ],
)
def test_a_missing_module_or_function_is_one_line_exit_2_nothing_written(
    own_job: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    job: str,
    needles: tuple[str, ...],
) -> None:
    before = _tree(tmp_path)
    assert main(["train", "--job", job.format(own=own_job), "--store", "s.zarr", *SMALL]) == 2
    err = _err_line(capsys)
    assert all(n in err for n in needles), err
    assert _tree(tmp_path) == before


def test_job_options_reach_the_config_typed_as_json(own_job: str) -> None:
    opts = [
        "hidden=8",
        "rate=0.5",
        "wide=true",
        "name=mlp-1",
        "sizes=[1, 2]",
        "blank=",
        "ratio=NaN",
        "huge=1e999",
        'quoted="8"',
        "eq=a=b",
    ]
    argv = ["train", "--job", f"{own_job}:build", "--store", "s.zarr", *SMALL]
    assert main([*argv, *(x for o in opts for x in ("--job-option", o))]) == 0
    want = {
        "hidden": 8,
        "rate": 0.5,
        "wide": True,
        "name": "mlp-1",
        "sizes": [1, 2],
        "blank": "",
        "ratio": "NaN",  # not a number a resume could match: kept as text
        "huge": "1e999",
        "quoted": "8",
        "eq": "a=b",
    }
    assert read_config("s.zarr").options == want
    assert sys.modules[own_job].SEEN == [want]  # the builder got them


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--job-option", "hidden8"), "--job-option 'hidden8' is not KEY=VALUE"),
        (("--job-option", "=8"), "is not KEY=VALUE"),
        (("--job-option", "hidden=8", "--job-option", "hidden=16"), "hidden is given twice"),
        (("--config", "job.json", "--job-option", "hidden=8"), "drop --job-option"),
    ],
)
def test_bad_job_options_are_one_line_exit_2_nothing_written(
    own_job: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    needle: str,
) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"job": f"{own_job}:build", "dp": {}}))
    before = _tree(tmp_path)
    job = () if "--config" in extra else ("--job", f"{own_job}:build", *SMALL)
    assert main(["train", *job, "--store", "s.zarr", *extra]) == 2
    assert needle in _err_line(capsys)
    assert _tree(tmp_path) == before


def test_a_resume_with_other_options_is_refused_listing_them(
    own_job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--job", f"{own_job}:build", "--store", "s.zarr", *SMALL]
    assert main([*argv, "--job-option", "hidden=8"]) == 0
    capsys.readouterr()
    before = _tree(tmp_path)
    assert main([*argv, "--job-option", "hidden=16", "--job-option", "deep=true"]) == 1
    err = capsys.readouterr().err
    assert "options.hidden: stored 8, now 16" in err and "options.deep" in err, err
    assert _tree(tmp_path) == before
    assert main([*argv, "--job-option", "hidden=8"]) == 0  # the same options resume


def test_audit_imports_no_job_the_store_names_only_one_given(
    own_job: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--job", f"{own_job}:build", "--store", "s.zarr", *SMALL]) == 0
    sys.modules.pop(own_job)
    mark = tmp_path / "imported.mark"
    monkeypatch.setenv("MARK_ENV", str(mark))
    # run from the folder that holds the module the store names: still not imported
    # (0 or 1: the findings are not what this test is about)
    assert main(["audit", "s.zarr", "--seed", "0", "--coordinates", "8"]) in (0, 1)
    assert not mark.exists() and own_job not in sys.modules
    # a job the user names, found beside them as `train --job` finds it
    report = audit_store(
        "s.zarr", coordinates=8, seed=0, job=resolve(f"{own_job}:build", search_cwd=True)
    )
    assert mark.exists() and "job" in report.info
    assert not [f for f in report.findings if f.check == "job"], report.text()  # its job
