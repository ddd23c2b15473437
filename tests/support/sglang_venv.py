"""Cached SGLang CPU test venvs, one per code shape (DOMAIN §4, §12).

- ``patch``: SGLang 0.5.10.post1, the last release without msprobe support: rl-msprobe's
  ``sglang-dump`` patch set puts the debugger in ``ModelRunner``.
- ``native``: SGLang 0.5.23, the newest on the index: ``--msprobe-dump-config`` (0.5.11+).

Recipe (DOMAIN §12): the local CPU ``torch`` held in every step; ``--no-deps`` sglang and the
index's torchvision 0.28.0; sglang's pure-Python needs per release and the real msprobe. Two
things the index ships broken for a CPU-only machine are mended here, in test support only
(never in ``rl_msprobe/``):

- torchvision 0.28.0 is a CUDA build: its ``_C.so`` needs ``libtorch_cuda.so``, so the meta /
  autograd registrations it imports at module level fail (``operator torchvision::nms does not
  exist``); they are imported only when the extension loaded;
- sglang imports ``sgl_kernel`` (``sgl_kernel.kvcacheio``) unconditionally: the ``.py`` files of
  the matching ``sglang-kernel`` wheel go into site-packages, without its ``.so`` files, plus an
  empty ``common_ops.py``. No sgl_kernel op is called on this CPU (no AMX).

Each venv is built once under ``~/.cache/rl-msprobe/venvs/sglang-<ver>-cpu`` behind a file lock
(override: ``RL_MSPROBE_SGLANG_VENV_<SHAPE>``), ~3 min and ~3.4 GB each.

    python -m tests.support.sglang_venv build            # both, e.g. in the background
    python -m tests.support.sglang_venv build patch      # one shape
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

from tests.support.venvs import CachedVenv, run_pip

TORCH = "torch==2.13.0+cpu"
TORCHVISION = "torchvision==0.28.0"
MSPROBE = "mindstudio-probe"
COMMON = (
    "numpy", "aiohttp", "anthropic", "blobfile==3.0.0", "build", "datasets", "einops", "fastapi",
    "gguf", "interegular", "msgspec", "ninja", "nvidia-ml-py", "openai-harmony==0.0.4", "orjson",
    "packaging", "partial_json_parser", "pillow", "prometheus-client", "psutil", "pybase64",
    "pydantic", "python-multipart", "pyzmq", "requests", "scipy", "sentencepiece", "setproctitle",
    "soundfile==0.13.1", "tiktoken", "tqdm", "mistral_common", "uvicorn", "uvloop", "watchfiles",
    "IPython", MSPROBE,
)  # fmt: skip
PER_RELEASE = {
    "0.5.10.post1": (
        "0.4.1",  # sglang-kernel whose .py files sglang imports
        ("transformers==5.3.0", "xgrammar==0.1.32", "openai==2.6.1", "llguidance<0.8.0,>=0.7.11",
         "apache-tvm-ffi<0.2,>=0.1.5", "smg-grpc-servicer>=0.5.0", "compressed-tensors"),
    ),
    "0.5.23": (
        "0.4.10",
        ("transformers==5.19.0", "xgrammar==0.2.7", "openai==2.8.0", "llguidance<2.0.0,>=1.7.6",
         "apache-tvm-ffi==0.1.11", "smg-grpc-servicer>=0.9.0", "compressed-tensors==0.18.0",
         "tokenizers==0.23.2", "easydict", "regex", "xxhash", "zstandard", "distro"),
    ),
}  # fmt: skip
SHAPES = {"patch": "0.5.10.post1", "native": "0.5.23"}  # code shape -> release
FIXUP_VERSION = 1  # bump when the fixups change: the stamp then rebuilds the venvs

TV_IMPORTS = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,
    io,
    models,
    ops,
    transforms,
    utils,
)  # usort:skip"""
TV_GUARDED = """from torchvision import datasets, io, models, ops, transforms, utils  # usort:skip

# rl-msprobe test venv: this CUDA build's _C.so cannot load without libtorch_cuda.so; the
# registrations below need its ops (torchvision::nms), so import them only when it loaded.
if extension._has_ops():
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401"""


def site_packages(python: Path) -> Path:
    found = sorted((python.parent.parent / "lib").glob("python3*/site-packages"))
    if len(found) != 1:
        raise RuntimeError(f"expected one site-packages under {python.parent.parent / 'lib'}, found {found}")
    return found[0]


def guard_torchvision(site: Path) -> None:
    init = site / "torchvision" / "__init__.py"
    text = init.read_text()
    if TV_GUARDED in text:
        return
    if TV_IMPORTS not in text:
        raise RuntimeError(f"{init}: the registration imports this fixup guards are not there any more")
    init.write_text(text.replace(TV_IMPORTS, TV_GUARDED, 1))


def add_sgl_kernel_python(python: Path, kernel: str, log: Path) -> None:
    """The .py files of sglang-kernel==KERNEL (no compiled ops) and an empty common_ops.py."""
    site = site_packages(python)
    with tempfile.TemporaryDirectory() as tmp:
        run_pip(python, "download", "-q", "--no-deps", "-d", tmp, f"sglang-kernel=={kernel}", log=log)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith("sgl_kernel/") and n.endswith(".py")]
            if not names:
                raise RuntimeError(f"{wheel.name} has no sgl_kernel/*.py")
            for name in names:
                zf.extract(name, site)
    (site / "sgl_kernel" / "common_ops.py").write_text(
        '"""rl-msprobe test venv: no compiled sgl_kernel ops on this CPU (none is called)."""\n'
    )


def make_fixup(kernel: str):
    def fixup(python: Path, log: Path) -> None:
        guard_torchvision(site_packages(python))
        add_sgl_kernel_python(python, kernel, log)

    return fixup


CHECK = (
    "import os; os.environ['SGLANG_USE_CPU_ENGINE'] = '1'; "
    "import torch, torchvision, msprobe, sgl_kernel.kvcacheio, sglang; "
    "from sglang.srt.model_executor import model_runner; "
    "from sglang.srt.entrypoints.engine import Engine; "
    "print(sglang.__version__, torch.__version__)"
)


def venv_for(release: str) -> CachedVenv:
    kernel, extra = PER_RELEASE[release]
    steps = (
        ("install", "-q", "--upgrade", "pip"),
        ("install", "-q", TORCH),
        ("install", "-q", "--no-deps", f"sglang=={release}", TORCHVISION),
        ("install", "-q", TORCH, *COMMON, *extra),
    )
    recipe = {
        "steps": [list(s) for s in steps],
        "check": CHECK,
        "fixup": {"torchvision_guard": TV_GUARDED, "sgl_kernel": kernel, "v": FIXUP_VERSION},
    }
    shape = next(name for name, rel in SHAPES.items() if rel == release)
    return CachedVenv(
        name=f"sglang-{release}-cpu",
        path_var=f"RL_MSPROBE_SGLANG_VENV_{shape.upper()}",
        skip_var="RL_MSPROBE_SKIP_SGLANG_E2E",
        skip_label=f"REAL SGLang {release} CPU RUNS",
        steps=steps,
        check=CHECK,
        recipe=recipe,
        min_free_gb=8,  # the venv (~3.4 GB) plus pip's download and unpack room
        fixup=make_fixup(kernel),
    )


VENVS = {shape: venv_for(release) for shape, release in SHAPES.items()}


def python_or_skip(shape: str) -> Path:
    """The python of the SGLang venv for SHAPE ("patch" or "native"); a loud skip if this
    machine cannot provide it."""
    return VENVS[shape].python_or_skip()


if __name__ == "__main__":
    if sys.argv[1:2] != ["build"] or any(a not in SHAPES for a in sys.argv[2:]):
        sys.exit(f"usage: python -m tests.support.sglang_venv build [{'|'.join(SHAPES)} ...]")
    for shape in sys.argv[2:] or list(SHAPES):
        print(shape, VENVS[shape].build())
