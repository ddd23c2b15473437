"""A real vLLM CPU engine for end-to-end tests: a cached test venv and a tiny local model.

The venv is the one shared test venv of ``tests/support/job_venv.py`` (vLLM CPU, verl,
msprobe; built once under ``~/.cache/rl-msprobe/venvs/verl-vllm-cpu``, override
``RL_MSPROBE_JOB_VENV``); a stamp file records the recipe, and a changed recipe rebuilds it.

Reusable by any e2e test::

    from tests.support import vllm_cpu
    python = vllm_cpu.venv_python_or_skip()          # pytest.skip with a loud reason if impossible
    model = vllm_cpu.tiny_model(python=python)       # cached under ~/.cache/rl-msprobe/models
    with vllm_cpu.patched(python, "vllm-dump"):      # through `rl-msprobe patch apply`, reverted after
        out = vllm_cpu.run_in_venv(python, script, env=vllm_cpu.engine_env(...), cwd=tmp_path)

Command line (build ahead of time, e.g. in the background)::

    python -m tests.support.job_venv build
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

from tests.support.job_venv import VENV  # one venv for verl, vLLM and the live job
from tests.support.venvs import VenvUnavailable, free_gb, main, run_pip

RECIPE = VENV.recipe
__all__ = ["VENV", "VenvUnavailable", "build", "venv_python_or_skip", "tiny_model", "patched", "run_in_venv"]
_pip = run_pip
_free_gb = free_gb
venv_dir = VENV.venv_dir
is_ready = VENV.is_ready


def build(venv: Path | None = None) -> Path:
    """Build (or reuse) the venv and return its python (see tests/support/venvs.py)."""
    venv = venv or venv_dir()
    return VENV.build(venv, free_of=lambda path: _free_gb(path))  # late-bound: tests replace _free_gb


def venv_python_or_skip() -> Path:
    """The venv's python, building it if needed; pytest.skip with a loud reason when the disk or
    the package index cannot provide it. Set RL_MSPROBE_SKIP_JOB_E2E=1 to skip on purpose."""
    return VENV.python_or_skip(free_of=lambda path: _free_gb(path))


TINY_MODEL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head size 32: the CPU attention needs >= 32
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

_TINY_MODEL_SCRIPT = r"""
import json, sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

out = Path(sys.argv[1]); spec = json.loads(sys.argv[2]); seed = int(sys.argv[3])
options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
out.mkdir(parents=True, exist_ok=True)
words = ("the a model rollout prefill decode tensor layer rank step dump probe engine token "
         "request batch train infer compare cosine error value cache query key attention").split()
sentences = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 9)) + "." for i in range(400)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"] - 8, special_tokens=["<|endoftext|>", "<|pad|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(sentences, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                               bos_token="<|endoftext|>")
if options.get("full_vocab"):  # len(tokenizer) == vocab_size: verl masks logits >= len(tokenizer)
    fast.add_special_tokens({"additional_special_tokens": [
        f"<|extra_{i}|>" for i in range(spec["vocab_size"] - len(fast))]})
    assert len(fast) == spec["vocab_size"], (len(fast), spec["vocab_size"])
if options.get("chat_template"):
    fast.chat_template = options["chat_template"]
fast.save_pretrained(out)
torch.manual_seed(seed)
config = Qwen2Config(**spec, eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id,
                     pad_token_id=fast.pad_token_id, tie_word_embeddings=True, torch_dtype="float32")
Qwen2ForCausalLM(config).save_pretrained(out)
print(json.dumps({"vocab": len(fast), "path": str(out)}))
"""


def models_dir() -> Path:
    return venv_dir().parent.parent / "models"


def tiny_model(
    dest: Path | None = None,
    python: Path | None = None,
    seed: int = 0,
    *,
    full_vocab: bool = False,
    chat_template: str | None = None,
) -> Path:
    """A random-weight Qwen2 (DOMAIN §7 sizes) and a byte-level BPE tokenizer, made locally with the
    venv's transformers / tokenizers (no hub). Same seed, same weights. Without DEST it is made
    once under the cache (`~/.cache/rl-msprobe/models/tiny-qwen2-s<seed>`) and reused.
    FULL_VOCAB pads the tokenizer with special tokens up to the model's vocab (a verl job needs
    `len(tokenizer) == vocab_size`); CHAT_TEMPLATE is saved with the tokenizer. Either one gives
    another cached folder (`tiny-qwen2-<hash>-s<seed>`)."""
    python = python or build()
    options = {k: v for k, v in {"full_vocab": full_vocab, "chat_template": chat_template}.items() if v}
    suffix = (
        f"-{hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]}" if options else ""
    )
    dest = dest or models_dir() / f"tiny-qwen2{suffix}-s{seed}"
    expected = {"spec": TINY_MODEL, "seed": seed, **({"options": options} if options else {})}
    args = (json.dumps(TINY_MODEL), str(seed), json.dumps(options))
    return cached_folder(dest, expected, python, _TINY_MODEL_SCRIPT, *args, what="the tiny model")


def cached_folder(dest: Path, key: dict, python: Path, script: str, *args: str, what: str) -> Path:
    """DEST, made once by the venv's python running SCRIPT with a staging folder and ARGS (no hub),
    then renamed into place; a stamp holding KEY, written last, marks it complete, and another
    KEY remakes it."""
    stamp = dest / "rl-msprobe-stamp.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_text()) == key:
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    proc = subprocess.run(
        [str(python), "-c", script, str(staging), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        timeout=600,
    )
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"making {what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (staging / stamp.name).write_text(json.dumps(key))
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


@contextlib.contextmanager
def patch_lock():
    """Held while the shared venv is patched (apply ... revert). Take it BEFORE the live-job lock
    of tests/support/live_job.py, never after: one order for everyone, no deadlock."""
    with (venv_dir().parent / f"{venv_dir().name}.patch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ROOT but Python's bytecode caches (rewritten by any import)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


@contextlib.contextmanager
def patched(python: Path, *sets: str):
    """The venv's installed vLLM patched with SETS (default vllm-dump) through rl-msprobe's own
    CLI (`rl-msprobe patch apply SETS --python PY`), reverted to the byte afterwards. Holds a
    file lock so that two test processes never patch the shared venv at once; yields the apply
    result (JSON) of the CLI."""
    from tests.support.trees import run_cli

    sets = sets or ("vllm-dump",)
    with patch_lock():
        code, out, err = run_cli("patch", "apply", *sets, "--python", str(python), "--json")
        if code != 0:
            raise RuntimeError(f"rl-msprobe patch apply {' '.join(sets)} --python {python} failed: {err}")
        try:
            yield json.loads(out)
        finally:
            code, _, err = run_cli("patch", "revert", *sets, "--python", str(python))
            if code != 0:
                raise RuntimeError(
                    f"rl-msprobe patch revert {' '.join(sets)} --python {python} failed: {err}"
                )


def engine_env(**extra: str) -> dict[str, str]:
    """The environment for an in-process vLLM CPU engine (DOMAIN §7), plus EXTRA."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "MSPROBE_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_V2_MODEL_RUNNER="0",
        TORCHDYNAMO_DISABLE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def venv_print(python: Path, code: str) -> str:
    """What CODE prints when the venv's python runs it (stripped)."""
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def site_packages(python: Path) -> Path:
    """The venv's site-packages directory (where `vllm/` is installed)."""
    return Path(venv_print(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))


def run_in_venv(python: Path, code: str, env: dict[str, str], cwd: Path, timeout: int = 900):
    """Run CODE (dedented) with the venv's python in a fresh process; returns CompletedProcess."""
    return subprocess.run(
        [str(python), "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


_GENERATE = """
import json, os, sys

def main():
    from vllm import LLM, SamplingParams

    result = {"pid": os.getpid()}
    try:
        llm = LLM(model=ARGS["model"], enforce_eager=ARGS["eager"], max_model_len=128, max_num_seqs=4, seed=0,
                  **ARGS["llm_kwargs"])
        params = SamplingParams(max_tokens=ARGS["max_tokens"], temperature=0, ignore_eos=True)
        result["outputs"] = [
            {"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids),
             "token_ids": list(o.outputs[0].token_ids)}
            for o in llm.generate(ARGS["prompts"], params)
        ]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    exec(ARGS["after"], {"result": result})
    result["msprobe_imported"] = "msprobe" in sys.modules
    print("RESULT " + json.dumps(result), flush=True)

if __name__ == "__main__":
    main()
"""


def generate(
    python: Path,
    model: Path,
    cwd: Path,
    prompts: list[str],
    max_tokens: int,
    *,
    eager: bool = True,
    after: str = "",
    llm_kwargs: dict | None = None,
    timeout: int = 900,
    **env: str,
) -> tuple[dict, subprocess.CompletedProcess]:
    """Greedy generation with `LLM(model, enforce_eager=EAGER, max_model_len=128, max_num_seqs=4,
    seed=0, **LLM_KWARGS)` in a fresh venv process (script written to CWD/rollout.py), with
    engine_env(**ENV). Returns ({"pid", "outputs": [{request_id, prompt_token_ids, token_ids}]
    or "error", "msprobe_imported", ...}, the process). AFTER is Python run at the end with
    `result` in scope (add keys to it)."""
    args = {
        "model": str(model),
        "eager": eager,
        "prompts": list(prompts),
        "max_tokens": max_tokens,
        "after": textwrap.dedent(after),
        "llm_kwargs": llm_kwargs or {},
    }
    script = cwd / "rollout.py"
    script.write_text(f"ARGS = {json.dumps(args)!r}\nimport json as _j\nARGS = _j.loads(ARGS)\n" + _GENERATE)
    proc = subprocess.run(
        [str(python), str(script)],
        capture_output=True,
        text=True,
        env=engine_env(**env),
        cwd=cwd,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM process failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :]), proc


if __name__ == "__main__":
    main(VENV, "vllm_cpu")
