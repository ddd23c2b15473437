"""Shared fixtures of the planner tests: the launch-script corpus and its expected results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "launch"
EXPECTED = json.loads((CORPUS / "expected.json").read_text(encoding="utf-8"))
SCRIPTS = sorted(EXPECTED)


@pytest.fixture(params=SCRIPTS)
def corpus_script(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, dict]:
    """A copy of one corpus script in a temporary folder (name, path, expected results)."""
    name = request.param
    path = tmp_path / name
    path.write_bytes((CORPUS / name).read_bytes())
    return name, path, EXPECTED[name]


@pytest.fixture(autouse=True)
def no_hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An empty Hugging Face cache: a model the machine happens to have cached (Qwen/Qwen2-7B-Instruct)
    must not change what consistency plans here (tests/data/hf_hub holds the models the tests use)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty_hf_hub")))
