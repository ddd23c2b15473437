"""Launch reader time against script size: linear, stated as a slope (ratios, not timed tests).

A realistic launch script (exports, `${X:-default}` variables, an argument array, comments,
a continued verl command) is grown by repeating its body to 0.1, 0.5, 1, 5, 10 and 50 MB.
For each size the reader (`parse_script`) and, as the baseline measured in the same process,
a bare pass over the same text with `str.splitlines` + a regex tokenizer are timed. The
output is seconds per MB for both, the reader / baseline ratio, and the log-log slope of
reader time against size (1.0 = linear, 2.0 = quadratic).

Run: python benchmarks/bench_launch_reader.py [--max-mb 50] [--repeat 1]
"""

from __future__ import annotations

import argparse
import math
import re

from bench_patch import best_of  # the same timing helper (this folder is on sys.path when run)

from rl_msprobe.launch.script import parse_script

BLOCK = """# settings for run {i}
export VLLM_ATTENTION_BACKEND_{i}=XFORMERS
MODEL_{i}=${{MODEL_{i}:-Qwen/Qwen2.5-7B-Instruct}}
TP_{i}=${{TP_{i}:-2}}
ARGS_{i}=(
    data.train_batch_size=$(( 16 * 4 ))
    actor_rollout_ref.model.path="$MODEL_{i}"  # the model
    'actor_rollout_ref.rollout.tensor_model_parallel_size='$TP_{i}
)
echo "run {i} with ${{ARGS_{i}[@]}}" > /dev/null
"""
COMMAND = """python3 -m verl.trainer.main_ppo \\
    actor_rollout_ref.rollout.name=vllm \\
    "${ARGS_0[@]}" \\
    trainer.total_epochs=1 "$@"
"""
_TOKENS = re.compile(r"""[^\s'"]+|'[^']*'|"(?:\\.|[^"\\])*"|\s+""")


def script_of(size: int) -> str:
    parts: list[str] = ["#!/bin/bash\nset -x\n"]
    total, i = 0, 0
    while total < size:
        block = BLOCK.format(i=i)
        parts.append(block)
        total += len(block)
        i += 1
    parts.append(COMMAND)
    return "".join(parts)


def baseline(text: str) -> int:
    count = 0
    for line in text.splitlines():
        count += sum(1 for _ in _TOKENS.finditer(line))
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mb", type=float, default=50)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    sizes = [s for s in (0.1, 0.5, 1, 5, 10, 50) if s <= args.max_mb]
    rows = []
    print(f"{'MB':>6} {'reader s':>9} {'s/MB':>7} {'baseline s':>11} {'ratio':>6}")
    for mb in sizes:
        text = script_of(int(mb * 1_000_000))
        script = parse_script(text)
        assert script.command is not None and script.command.args[1].value.text == "data.train_batch_size=64"
        reader = best_of(lambda text=text: parse_script(text), args.repeat)
        base = best_of(lambda text=text: baseline(text), args.repeat)
        rows.append((len(text) / 1e6, reader))
        print(
            f"{len(text) / 1e6:6.1f} {reader:9.2f} {reader / (len(text) / 1e6):7.2f} {base:11.2f} {reader / base:6.1f}"
        )
    if len(rows) >= 2:
        (x0, y0), (x1, y1) = rows[0], rows[-1]
        slope = math.log(y1 / y0) / math.log(x1 / x0)
        print(f"slope of log(time) against log(size), {x0:.1f} -> {x1:.1f} MB: {slope:.2f} (1.0 = linear)")


if __name__ == "__main__":
    main()
