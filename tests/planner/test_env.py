"""`rl-msprobe env` against real second interpreters (venvs made here, cached under
~/.cache/rl-msprobe/venvs/): one without msprobe, one that sees the real mindstudio-probe.
The install path is exercised with a local wheelhouse holding a stand-in
`mindstudio-probe` wheel (PIP_NO_INDEX + PIP_FIND_LINKS), so no network is needed."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from rl_msprobe.cli import main
from rl_msprobe.upstream.release_cache import cache_dir


def make_venv(path: Path, system_site: bool = False) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        args = [sys.executable, "-m", "venv", *(["--system-site-packages"] if system_site else []), str(path)]
        subprocess.run(args, check=True, capture_output=True)
    return python


@pytest.fixture(scope="module")
def bare_python() -> Path:
    return make_venv(cache_dir() / "venvs" / "planner-env-bare")


@pytest.fixture(scope="module")
def msprobe_python() -> Path:
    """A second interpreter that sees the msprobe the test interpreter has, wherever the suite runs.

    A `--system-site-packages` venv would see the *base* interpreter's packages, not those of a
    venv or container the suite runs in; instead a plain venv gets a .pth file naming the folders
    the running interpreter imports msprobe (and its dependencies) from.
    """
    spec = importlib.util.find_spec("msprobe")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mindstudio-probe is not installed in the test interpreter (pip install -e '.[msprobe]')")
    python = make_venv(cache_dir() / "venvs" / "planner-env-sees-msprobe")
    folders = [str(Path(p).parent) for p in spec.submodule_search_locations]
    folders += [p for p in sys.path if p.endswith("-packages") and p not in folders]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "rl_msprobe_test_outer_site.pth").write_text("\n".join(dict.fromkeys(folders)) + "\n")
    return python


def run_env(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["env", *args, "--json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def importable(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import msprobe"], capture_output=True).returncode == 0


def test_missing_msprobe_with_no_install_never_installs(bare_python: Path) -> None:
    code, doc = run_env("--python", str(bare_python), "--no-install")
    assert code == 1 and doc["ok"] is False
    assert doc["install_attempted"] is False
    assert doc["manual_commands"] == [
        f"{bare_python} -m pip install mindstudio-probe",
        f"{bare_python} -c \"from msprobe.pytorch import PrecisionDebugger; print('OK')\"",
    ]
    assert not importable(bare_python)


def test_human_output_stops_the_workflow(bare_python: Path) -> None:
    result = CliRunner().invoke(main, ["env", "--python", str(bare_python), "--no-install"])
    assert result.exit_code == 1
    assert "pip install mindstudio-probe" in result.output and "Stop here" in result.output


def test_real_msprobe_is_found_with_its_version(msprobe_python: Path) -> None:
    code, doc = run_env("--python", str(msprobe_python), "--no-install")
    assert code == 0 and doc["ok"] is True
    assert doc["msprobe_version"] and doc["msprobe_version"].split(".")[0].isdigit()
    assert doc["executable"].startswith(str(msprobe_python.parent.parent))


def test_interpreter_given_as_a_command_prefix(bare_python: Path) -> None:
    # like `docker exec -i NAME python3`: a command that ends in an interpreter
    code, doc = run_env("--python", f"env PYTHONNOUSERSITE=1 {bare_python}", "--no-install")
    assert code == 1 and doc["executable"].startswith(str(bare_python.parent.parent))
    assert (
        doc["manual_commands"][0] == f"env PYTHONNOUSERSITE=1 {bare_python} -m pip install mindstudio-probe"
    )


def _stand_in_wheel(folder: Path) -> Path:
    """A tiny wheel named mindstudio-probe that provides msprobe.pytorch.PrecisionDebugger."""
    files = {
        "msprobe/__init__.py": "",
        "msprobe/pytorch/__init__.py": "class PrecisionDebugger:\n    pass\n",
        "mindstudio_probe-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: mindstudio-probe\nVersion: 0.0.1\n",
        "mindstudio_probe-0.0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("mindstudio_probe-0.0.1.dist-info/RECORD,,")
    files["mindstudio_probe-0.0.1.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / "mindstudio_probe-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


def test_install_fails_then_succeeds_with_that_interpreters_pip(
    bare_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a copy of the cached bare venv (its python is a symlink, pip runs as `python -m pip`):
    # seconds instead of a new venv's ensurepip, and the cached one stays without msprobe
    shutil.copytree(bare_python.parent.parent, tmp_path / "venv", symlinks=True)
    python = tmp_path / "venv" / "bin" / "python"
    house = tmp_path / "wheelhouse"
    house.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    # nothing to install from: exit 1, the manual commands, nothing installed
    code, doc = run_env("--python", str(python))
    assert code == 1 and doc["install_attempted"] is True and doc["installed_now"] is False
    assert "pip install failed" in doc["error"] and len(doc["manual_commands"]) == 2
    assert not importable(python)
    # with the package available: installed by that interpreter's pip, then verified, and said so
    _stand_in_wheel(house)
    result = CliRunner().invoke(main, ["env", "--python", str(python)], catch_exceptions=False)
    assert result.exit_code == 0 and importable(python), result.output
    assert (
        "INSTALLED mindstudio-probe 0.0.1" in result.output
        and "pip install mindstudio-probe" in result.output
    )
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "mindstudio-probe"], check=True)
    code, doc = run_env("--python", str(python))
    assert code == 0, doc
    assert doc["installed_now"] is True and doc["msprobe_version"] == "0.0.1"
    assert doc["installed"] == "mindstudio-probe==0.0.1"
    assert importable(python)
    result = CliRunner().invoke(main, ["env", "--python", str(python)], catch_exceptions=False)
    assert "nothing installed" in result.output and "INSTALLED" not in result.output
    # the tool's own interpreter was not touched
    assert (
        "0.0.1"
        not in subprocess.run(
            [sys.executable, "-m", "pip", "show", "mindstudio-probe"], capture_output=True, text=True
        ).stdout
    )


def test_unknown_interpreter_is_bad_input() -> None:
    result = CliRunner().invoke(main, ["env", "--python", "/no/such/python3", "--no-install"])
    assert result.exit_code == 2 and "not found" in result.output


def test_prepare_refuses_when_msprobe_is_missing(bare_python: Path, tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[2] / "fixtures" / "launch" / "run_qwen2_7b_grpo_fsdp_vllm.sh"
    script = tmp_path / src.name
    script.write_bytes(src.read_bytes())
    args = ["prepare", str(script), "--mode", "inference", "--python", str(bare_python), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and json.loads(result.stdout)["written"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]
    result = CliRunner().invoke(main, [*args[:-1], "--no-env-check", "--json"])
    assert result.exit_code == 0, result.output
    record = next(tmp_path.glob("msprobe_*/rl-msprobe-python.json"))
    assert json.loads(record.read_text()) == {"python": str(bare_python)}
    assert any("recorded --python" in n for n in json.loads(result.stdout)["notes"])
    # `dumps compare` finds it from the default dump folders below the configs
    from rl_msprobe.dumps.compare import recorded_python

    (record.parent / "dump" / "actor").mkdir(parents=True)
    assert recorded_python([record.parent / "dump" / "actor"]) == (str(bare_python), record)
