"""vllm-ascend-dispatch-log on real vLLM-Ascend releases, fetched from the package index (cached).

vLLM-Ascend publishes x86-64 wheels for some releases and only sdists for others (whose build
needs CANN): `fetch_release` unpacks a wheel, or takes the unpacked sdist tree pip leaves behind
when its metadata step fails — nothing is built either way.
"""

from __future__ import annotations

import json

import pytest

from rl_msprobe.codemods.vllm_ascend_model_runner import VllmAscendModelRunner
from rl_msprobe.patches.default_release import newest_tested
from rl_msprobe.upstream import detect_version, fetch_release
from tests.support.tiers import newest_in_default
from tests.support.trees import full_cycle, run_cli, scratch_copy, snapshot

release = pytest.mark.release

# newest on the index when this was written (`pip index versions vllm-ascend --pre`); also the
# set's default release (`rl-msprobe patch list`)
NEWEST_PRE_RELEASE = newest_tested()["vllm-ascend"]
# (version, log lines before a dump finish point, attach lines after a debugger creation)
FULL_CYCLE = [
    ("0.12.0rc1", 4, 1),  # stop() in `if need_dump:` blocks
    ("0.13.0", 4, 1),  # stop() under `if self.debugger is not None:`
    ("0.18.0", 3, 1),  # 2 + 1 stop()
    ("0.23.0.post1", 4, 2),  # _finalize_dump_data(); PrecisionDebugger or AclGraphDumper (sdist only)
    (NEWEST_PRE_RELEASE, 4, 2),
]
FILES = {
    "vllm_ascend/worker/model_runner_v1.py",
    "vllm_ascend/worker/dispatch_logger.py",
    "vllm_ascend/worker/rl_msprobe_records.py",
}


@release
@pytest.mark.parametrize(
    ("version", "logs", "attaches"), newest_in_default(FULL_CYCLE, version=lambda p: p[0])
)
def test_full_cycle(version, logs, attaches, tmp_path):
    tree = scratch_copy("vllm-ascend", version, tmp_path / f"vllm-ascend-{version}")
    assert detect_version(tree, "vllm-ascend") == version
    source = (tree / VllmAscendModelRunner.path).read_text()
    status = full_cycle(tree, ["vllm-ascend-dispatch-log"])
    (entry,) = status["sets"]
    assert entry["status"] == "applied" and {f["path"] for f in entry["files"]} == FILES
    patched = VllmAscendModelRunner().apply(source, version)
    assert patched.count("dispatch_logger.log_step(self, scheduler_output)") == logs
    assert patched.count("dispatch_logger.attach(self)") == attaches
    # per-token records (no NPU here: proven by shape): one start right before the model forward of
    # execute_model (`_model_forward`, or `_generate_process_reqs_hidden_states` up to 0.14), one
    # decorator on execute_model that writes the record on every way out
    lines = patched.splitlines()
    (start,) = [
        i for i, line in enumerate(lines) if "dispatch_logger.start_records(self, scheduler_output)" in line
    ]
    assert (
        lines[start + 1]
        .strip()
        .startswith(
            (
                "hidden_states = self._model_forward(",
                "hidden_states = self._generate_process_reqs_hidden_states(",
            )
        )
    )
    (deco,) = [i for i, line in enumerate(lines) if "@dispatch_logger.record_step" in line]
    assert "def execute_model(" in "\n".join(lines[deco + 1 : deco + 3]) and deco < start


@release
def test_no_msprobe_support_before_0_12_is_refused(tmp_path):
    tree = scratch_copy("vllm-ascend", "0.11.0", tmp_path / "vllm-ascend", with_git=False)
    before = snapshot(tree)
    code, _, err = run_cli("patch", "apply", "vllm-ascend-dispatch-log", "--tree", str(tree))
    assert code == 2 and "0.11.0" in err and "0.12.0rc1" in err
    assert snapshot(tree) == before


@release
def test_sdist_only_release_is_unpacked_not_built():
    root = fetch_release("vllm-ascend", "0.23.0.post1")
    assert (root / "vllm_ascend" / "worker" / "model_runner_v1.py").is_file()
    assert detect_version(root, "vllm-ascend") == "0.23.0.post1"
    assert not list(root.rglob("*.so")), "nothing may be compiled"


@release
def test_diff_on_fetched_newest_pre_release():
    spec = f"release:vllm-ascend=={NEWEST_PRE_RELEASE}"
    code, out, err = run_cli(
        "patch", "diff", "vllm-ascend-dispatch-log", "--tree", spec, "--json", "--exit-code"
    )
    assert code == 1, err
    doc = json.loads(out)
    assert doc["version"] == NEWEST_PRE_RELEASE
    assert {f["path"] for f in doc["summary"]["files"]} == FILES
    assert doc["summary"]["removed"] == 0


@release
def test_fresh_fetch_of_an_sdist_only_release(tmp_path, monkeypatch):
    """No wheel for 0.23.0.post1: pip's metadata step fails (CANN), the unpacked tree is kept."""
    monkeypatch.setenv("RL_MSPROBE_CACHE", str(tmp_path / "cache"))
    root = fetch_release("vllm-ascend", "0.23.0.post1")
    assert root.parent == tmp_path / "cache" / "releases"
    assert sorted(p.name for p in root.iterdir()) == ["PKG-INFO", "vllm_ascend"]
    assert detect_version(root, "vllm-ascend") == "0.23.0.post1"
    left = [p.name for p in (tmp_path / "cache" / "releases").glob(".*") if p.is_dir()]
    assert not left, f"no temporary folder may be left behind: {left}"
    # the fetch's lock file stays by design (upstream/release_cache._fetch_lock), and nothing else
    assert [p.name for p in (tmp_path / "cache" / "releases").glob(".*")] == [
        ".vllm-ascend-0.23.0.post1.lock"
    ]


@pytest.mark.parametrize(
    "text",
    [
        "__version__ = version = '0.13.0rc2'\n__version_tuple__ = version_tuple = (0, 13, 0)\n",  # setuptools-scm
        "version: str\n__version__: str\n__version__ = version = '0.13.0rc2'\n",
        '__version__ = "0.13.0rc2"\n',
    ],
)
def test_version_from_a_checkout_version_file(tmp_path, text):
    (tmp_path / "vllm_ascend").mkdir()
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    (tmp_path / "vllm_ascend" / "_version.py").write_text(text)
    assert detect_version(tmp_path, "vllm-ascend") == "0.13.0rc2"


# vLLM-Ascend's own V2 runner (issue 33, item 6): never a msprobe dump of its own, and its model step
# is vLLM's V2 GPUModelRunner.execute_model (the method vllm-dump patches in the vLLM tree)
V2_RUNNER = "vllm_ascend/worker/v2/model_runner.py"
V2_RELEASES = [
    *(pytest.param(v, marks=pytest.mark.full) for v in ("0.13.0", "0.18.0", "0.23.0.post1", "0.28.0rc1")),
    NEWEST_PRE_RELEASE,
]


@release
@pytest.mark.parametrize("version", V2_RELEASES)
def test_the_v2_runner_has_no_dump_and_runs_vllms_v2_execute_model(version):
    import ast

    source = (fetch_release("vllm-ascend", version) / V2_RUNNER).read_text()
    assert "msprobe" not in source and "PrecisionDebugger" not in source and "dump_config" not in source
    tree = ast.parse(source)
    imports = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    (runner,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NPUModelRunner"]
    (base,) = [ast.unparse(b) for b in runner.bases]
    assert imports.get(base) == "vllm.v1.worker.gpu.model_runner", (base, imports.get(base))
    methods = {n.name: n for n in runner.body if isinstance(n, ast.FunctionDef)}
    if "execute_model" in methods:  # 0.28 on: wraps the parent's
        calls = [ast.unparse(c.func) for c in ast.walk(methods["execute_model"]) if isinstance(c, ast.Call)]
        assert "super().execute_model" in calls
    assert "self.model(" not in source  # the forward itself stays in vLLM's execute_model
