"""vllm-ascend-dispatch-log on real vLLM-Ascend releases, fetched from the package index (cached).

vLLM-Ascend publishes x86-64 wheels for some releases and only sdists for others (whose build
needs CANN): `fetch_release` unpacks a wheel, or takes the unpacked sdist tree pip leaves behind
when its metadata step fails — nothing is built either way.
"""

from __future__ import annotations

import json

import pytest

from rl_msprobe.codemods.vllm_ascend_model_runner import VllmAscendModelRunner
from rl_msprobe.patches.releases import newest_tested
from rl_msprobe.upstream import detect_version, fetch_release
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
FILES = {"vllm_ascend/worker/model_runner_v1.py", "vllm_ascend/worker/dispatch_logger.py"}


@release
@pytest.mark.parametrize(("version", "logs", "attaches"), FULL_CYCLE)
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
    # the fetch's lock file stays by design (upstream/releases._fetch_lock), and nothing else
    assert [p.name for p in (tmp_path / "cache" / "releases").glob(".*")] == [".vllm-ascend-0.23.0.post1.lock"]


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
