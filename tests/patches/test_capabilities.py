"""The capability model: shape decides, a promised capability with no site is exit 2, versions only warn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.trees import git, run_cli, scratch_copy, snapshot

AGENT_LOOP = "verl/experimental/agent_loop/agent_loop.py"
LLM_SERVER = "verl/workers/rollout/llm_server.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "codemods"


@pytest.fixture
def tree(tmp_path):
    return scratch_copy("verl", "0.9.1", tmp_path / "verl")


def _edit(tree: Path, rel: str, old: str, new: str) -> None:
    path = tree / rel
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    git(tree, "commit", "-qam", f"edit {rel}")


def test_a_capability_without_a_site_is_exit_2_naming_it_and_every_file_searched(tree):
    """No rollout client the codemods know: no silent diff without a request-id site."""
    _edit(tree, LLM_SERVER, "class LLMServerClient", "class RolloutClient")
    before = snapshot(tree)
    for command in ("diff", "apply", "status"):
        code, out, err = run_cli("patch", command, "verl-request-id", "--tree", str(tree))
        assert code == 2, (command, out, err)
        assert "capability 'request-id record'" in err
        assert f"searched {AGENT_LOOP} has no class AsyncLLMServerManager" in err
        assert f"; {LLM_SERVER} has no class LLMServerClient" in err
    assert snapshot(tree) == before


def test_engine_that_never_runs_the_actor_refuses_consistency_but_not_its_parts(tree):
    """verl 0.6.x's shape: no engine ActorRolloutRefWorker, so the engine hook would never dump."""
    _edit(tree, ENGINE_WORKERS, "class ActorRolloutRefWorker(", "class LegacyActorRolloutRefWorker(")
    code, _, err = run_cli("patch", "diff", "verl-consistency", "--tree", str(tree))
    assert code == 2 and "engine runs the actor" in err and "legacy workers" in err and ENGINE_WORKERS in err
    for part in ("verl-prompts-only", "verl-request-id", "verl-engine"):
        code, _, err = run_cli("patch", "diff", part, "--tree", str(tree), "--exit-code")
        assert code == 1, (part, err)


def test_newer_dev_tree_is_patched_untested_and_status_lists_the_capabilities_found(tree):
    _edit(tree, "verl/version/version", "0.9.1", "0.10.0.dev")
    code, out, err = run_cli("patch", "status", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["tested"] is False and "newer than the newest tested release 0.9.1" in doc["warnings"][0]
    caps = {c["name"]: c for c in doc["sets"][0]["capabilities"]}
    assert set(caps) == {
        "FSDP engine hook",
        "Megatron engine hook",
        "PROMPTS_ONLY trim",
        "request-id record",
        "engine runs the actor",
    }
    assert all(c["found"] for c in caps.values())
    assert caps["request-id record"]["sites"] == [LLM_SERVER]
    assert "verl/trainer/ppo/v1/trainer_base.py" in caps["PROMPTS_ONLY trim"]["sites"]
    code, out, err = run_cli("patch", "status", "verl-consistency", "--tree", str(tree))
    assert "capability found: request-id record (verl/workers/rollout/llm_server.py)" in out
    assert "warning: verl-consistency: verl 0.10.0.dev is newer than the newest tested release 0.9.1" in err
    code, out, err = run_cli("patch", "apply", "verl-consistency", "--tree", str(tree), "--json")
    assert code == 0, err
    assert json.loads(out)["tested"] is False


def test_tested_release_says_tested(tree):
    code, out, _ = run_cli("patch", "diff", "verl-engine", "--tree", str(tree), "--json", "--exit-code")
    assert code == 1 and json.loads(out)["tested"] is True and json.loads(out)["warnings"] == []


def _sglang_tree(root: Path, version: str, native_field: bool) -> Path:
    runner = root / "sglang" / "srt" / "model_executor" / "model_runner.py"
    runner.parent.mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "version.py").write_text(f'__version__ = "{version}"\n')
    # SGLang >= 0.5.11: ModelRunner makes its own debugger from the server argument (DOMAIN §4)
    native = "\n    def init_msprobe(self):\n        self.msprobe_debugger = None\n" if native_field else ""
    runner.write_text((FIXTURES / "sglang-model-runner" / "dp_rank_v051.before.py").read_text() + native)
    return root


@pytest.mark.parametrize(
    ("version", "native_field", "native"), [("0.5.10", True, True), ("0.5.12", False, False)]
)
def test_native_sglang_support_is_recognised_from_the_code(tmp_path, version, native_field, native):
    tree = _sglang_tree(tmp_path / "sglang", version, native_field)
    code, _, err = run_cli("patch", "diff", "sglang-dump", "--tree", str(tree))
    if native:
        assert code == 2 and "self.msprobe_debugger" in err and "msprobe_dump_config=" in err
    else:
        assert code == 0 and "newer than the newest tested release 0.5.10.post1" in err
    code, out, _ = run_cli("patch", "status", "sglang-dump", "--tree", str(tree), "--json")
    assert (json.loads(out)["sets"][0]["status"] == "native") is native
