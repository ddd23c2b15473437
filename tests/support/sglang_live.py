"""A user's rl-msprobe session around a real SGLang CPU engine (DOMAIN §12), through the real CLI.

A plain verl launch script with an SGLang rollout goes through `detect`, `prepare --mode
inference --backend sglang --python PY` and `patch apply` of exactly the sets prepare printed;
bash itself then says what the derived script passes (tests/support/bash_argv.py), and the
engine those arguments imply runs: the Ray runtime-env variables become the engine's
environment (as verl hands them to its rollout workers), `engine_kwargs.sglang.*` become server
arguments, `enforce_eager=True` turns CUDA graphs off. The engine is SGLang's own offline
`Engine` (scheduler in a spawned subprocess) on a tiny local Qwen2 with a capped KV cache.
On exit the sets are reverted and the venv's sglang tree must be byte-identical.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import bash_argv, live_flow, vllm_cpu
from tests.support.sglang_venv import VENVS, site_packages

ROLLOUT = "actor_rollout_ref.rollout."
ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars."
SGLANG_PREFIX = ROLLOUT + "engine_kwargs.sglang."
KV_TOKENS = 4096  # DOMAIN §12: without a cap SGLang takes 84 % of host RAM for the KV cache
PROMPTS = ("the model rollout prefill", "a tensor layer rank step dump")
MAX_NEW_TOKENS = 4

# Runs in the SGLang venv. The main process never imports msprobe: with the sglang-dump patch the
# dumps can only come from the scheduler subprocess's ModelRunner.
ENGINE_SCRIPT = r"""
import json, os, sys
spec = json.loads(sys.argv[1])

def main():
    import sglang
    engine = sglang.Engine(model_path=spec["model"], device="cpu", max_total_tokens=spec["kv_tokens"],
                           log_level="warning", random_seed=0, **spec["server_args"])
    try:
        outs = engine.generate(spec["prompts"], {"max_new_tokens": spec["max_new_tokens"], "temperature": 0})
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"texts": [o["text"] for o in outs],
                                  "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in outs],
                                  "main_imported_msprobe": "msprobe" in sys.modules,
                                  "sglang": sglang.__version__}))

if __name__ == "__main__":
    main()
"""


def plain_script(model: Path, *extra: str) -> str:
    """The user's launch script: plain verl with an SGLang rollout, nothing of rl-msprobe."""
    lines = (
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        *extra,
    )
    body = " \\\n".join(f"    {line}" for line in lines)
    return (
        "#!/usr/bin/env bash\n# GRPO with an SGLang rollout on a tiny Qwen2.\nset -xeuo pipefail\n\n"
        f'python3 -m verl.trainer.main_ppo \\\n{body} \\\n    "$@"\n'
    )


def _value(text: str) -> str:
    """A Hydra override value as the program sees it: the quotes bash kept are Hydra's."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def implied_engine(argv: list[str]) -> tuple[dict[str, str], dict[str, object]]:
    """(environment, server arguments) that a verl command's overrides give its SGLang rollout."""
    env: dict[str, str] = {}
    server_args: dict[str, object] = {}
    for token in argv:
        key, sep, value = token.lstrip("+").partition("=")
        if not sep:
            continue
        if key.startswith(ENV_PREFIX):
            env[key[len(ENV_PREFIX) :]] = _value(value)
        elif key.startswith(SGLANG_PREFIX):
            server_args[key[len(SGLANG_PREFIX) :]] = _value(value)
        elif key == ROLLOUT + "enforce_eager" and value.lower() == "true":
            server_args["disable_cuda_graph"] = True
        elif key == ROLLOUT + "data_parallel_size" and int(value) > 1:
            server_args["dp_size"] = int(value)
    return env, server_args


@dataclass
class EngineRun:
    returncode: int
    seconds: float
    result: dict
    log: str

    def tail(self, chars: int = 6000) -> str:
        return self.log[-chars:]


def run_engine(
    python: Path, model: Path, env: dict[str, str], server_args: dict, cwd: Path, timeout: int = 900
) -> EngineRun:
    """SGLang's offline Engine in the venv with ENV and SERVER_ARGS: 2 prompts, greedy."""
    spec = {
        "model": str(model),
        "kv_tokens": KV_TOKENS,
        "server_args": server_args,
        "prompts": list(PROMPTS),
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    full_env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SGLANG_", "MSPROBE_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")
        },
        "SGLANG_USE_CPU_ENGINE": "1",  # DOMAIN §12
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **env,  # what the derived script gives the rollout
    }
    script = cwd / "run_sglang_engine.py"
    script.write_text(ENGINE_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run(
        [str(python), str(script), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
    )
    seconds = time.monotonic() - started
    log = f"$ {shlex.join(map(str, proc.args[:2]))} ...\n{proc.stdout}\n{proc.stderr}"
    result = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return EngineRun(proc.returncode, seconds, result, log)


@contextlib.contextmanager
def patch_lock(python: Path):
    """Held while a shared SGLang venv is patched (apply ... run ... revert)."""
    venv = python.parent.parent
    with (venv.parent / f"{venv.name}.patch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class Session:
    python: Path
    script: Path
    detection: dict
    prepared: dict
    argv: list[str]
    env: dict[str, str]
    server_args: dict
    applied: dict = field(default_factory=dict)

    @property
    def sets(self) -> list[str]:
        return list(self.prepared["patch_sets"])

    @property
    def dump_root(self) -> Path:
        return Path(json.loads(Path(self.prepared["configs"]["generate"]).read_text())["dump_path"])


def sglang_tree(python: Path) -> Path:
    return site_packages(python) / "sglang"


@contextlib.contextmanager
def session(python: Path, script: Path, work: Path, *prepare_args: str):
    """The user's steps on SCRIPT up to patched trees and the implied engine; reverts on exit and
    checks the venv's sglang tree is byte-identical to before."""
    with patch_lock(python):
        tree = sglang_tree(python)
        before = vllm_cpu.tree_digest(tree)
        code, detection, proc = live_flow.cli_json("detect", str(script), "--hint", "推理采集")
        assert code == 0, live_flow.describe(proc)
        code, prepared, proc = live_flow.cli_json(
            "prepare", str(script), "--mode", "inference", "--backend", "sglang", "--python", str(python),
            *prepare_args,
        )  # fmt: skip
        assert code == 0 and prepared["written"], live_flow.describe(proc)
        calls = [
            c
            for c in bash_argv.record(Path(prepared["script"]), work / "argv")
            if "verl.trainer.main_ppo" in c
        ]
        assert len(calls) == 1, calls
        env, server_args = implied_engine(calls[0])
        flow = Session(python, script, detection, prepared, calls[0], env, server_args)
        applied = False
        try:
            if flow.sets:
                code, flow.applied, proc = live_flow.cli_json(
                    "patch", "apply", *flow.sets, "--python", str(python)
                )
                assert code == 0, live_flow.describe(proc)
                applied = True
            yield flow
        finally:
            if applied:
                proc = live_flow.cli("patch", "revert", *flow.sets, "--python", str(python))
                assert proc.returncode == 0, live_flow.describe(proc)
            after = vllm_cpu.tree_digest(tree)
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            assert not changed, f"site-packages/sglang differs after `patch revert`: {changed[:20]}"


def python_or_skip(shape: str) -> Path:
    return VENVS[shape].python_or_skip()
