"""`patch status SET1 SET2 --python PY` where one interpreter imports both trees (verl and vLLM in
the shared test venv): one status per tree, exit 1 while nothing is applied. Read-only."""

from __future__ import annotations

import pytest

from tests.support import job_venv, live_flow, vllm_cpu

pytestmark = pytest.mark.e2e


def test_status_of_sets_for_two_projects_through_one_interpreter():
    python = str(job_venv.venv_python_or_skip())
    with vllm_cpu.patch_lock():  # nobody patches the shared venv meanwhile
        code, doc, proc = live_flow.cli_json(
            "patch", "status", "verl-engine", "vllm-dump", "--python", python
        )
        text = live_flow.cli("patch", "status", "verl-engine", "vllm-dump", "--python", python)
    assert code == 1, live_flow.describe(proc)  # the shared venv is kept unpatched between tests
    site = vllm_cpu.site_packages(python)
    trees = {t["project"]: t for t in doc["trees"]}
    assert sorted(trees) == ["verl", "vllm"]
    assert trees["verl"]["tree"] == str(site) and trees["verl"]["version"] == "0.9.1"
    assert [s["name"] for s in doc["sets"]] == ["verl-engine", "vllm-dump"]
    assert all(s["status"] == "absent" for s in doc["sets"]), doc["sets"]
    assert text.returncode == 1, live_flow.describe(text)
    assert "verl-engine: absent" in text.stdout and "vllm-dump: absent" in text.stdout
