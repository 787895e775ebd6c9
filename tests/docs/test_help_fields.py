"""`help()` on a public dataclass shows every field with its description: the class
docstring's Attributes section lists them (attribute docstrings are invisible to help)."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re

import pytest

import cocoon_ckpt
import state
from cocoon_ckpt.embedding import EmbeddingConfig
from cocoon_ckpt.tiers import TierConfig


def _public_dataclasses() -> list[type]:
    named = [getattr(cocoon_ckpt, n) for n in cocoon_ckpt.__all__]
    named += [getattr(state, n) for n in state.__all__]
    named += [TierConfig, EmbeddingConfig]  # the sections a JobConfig takes
    return [c for c in named if isinstance(c, type) and dataclasses.is_dataclass(c)]


def _attributes(doc: str) -> dict[str, str]:
    """name -> description of the docstring's Google-style Attributes section."""
    section = doc.split("\nAttributes:\n", 1)[1]
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        if not line.strip() or not line.startswith("    "):
            break  # the section ends at a blank or unindented line
        head = re.match(r"    (\w+)( \([^)]*\))?: (.*)", line)
        if head:
            name = head.group(1)
            entries[name] = head.group(3)
        elif name is not None and line.startswith("        "):
            entries[name] += " " + line.strip()
    return entries


def test_the_config_classes_are_covered() -> None:
    names = {c.__name__ for c in _public_dataclasses()}
    assert {"DPConfig", "JobConfig", "JobParts", "ResumeAllowances"} <= names


@pytest.mark.parametrize("cls", _public_dataclasses(), ids=lambda c: c.__name__)
def test_help_shows_every_field_with_its_description(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    assert "\nAttributes:\n" in doc, f"{cls.__name__}: no Attributes section"
    described = _attributes(doc)
    public = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    assert [n for n in public if n not in described] == [], cls.__name__
    assert [n for n in described if n not in public] == [], f"{cls.__name__}: stale entries"
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    # help() prefixes a class's lines with " |  "; compare the words
    shown = " ".join(" ".join(ln.strip().lstrip("|").split()) for ln in rendered.splitlines())
    for name in public:
        assert described[name].strip(), f"{cls.__name__}.{name}: empty description"
        assert f"{name}: {described[name]}" in shown, f"{cls.__name__}.{name} not in help()"
