"""Cost of the weight fingerprints on the live 2-rank job's syncs (issue 35 item 3, the 2-rank figure).

The live tp2 job's configuration (tests/support/live_job.py: FSDP2 world 2, one vLLM CPU server
with TP = 2, the tiny fp32 Qwen2 of DOMAIN §8), run twice with the same verl-weights-patched copy
of the venv's verl first on PYTHONPATH: once with RL_MSPROBE_WEIGHTS_DIR set, once without (the
patched lines then return at once). verl times each training step's sync itself
(`timing_s/update_weights` in its console metrics, `marked_timer("update_weights")` around
`checkpoint_manager.update_weights`; the sync before the first step is not timed), so the figure
is per step, the same steps of both runs, run one after the other (not interleaved: a job takes
minutes). Afterwards `rl-msprobe weights compare` must say EQUAL for the fingerprinted run.

Measured 2026-12-04 19:35-19:42 UTC (load 1.6-3.0, the machine shared), 3 steps: 0.139 / 0.114 /
0.121 s without, 0.144 / 0.120 / 0.121 s with: 1.035x median [1.00-1.06]; EQUAL, 4 syncs, 27
tensors (1.6 MB fp32), every received record reused from sent; jobs 165 s and 126 s.

With lazy statistics (bc43076; TP 2: each rank measures what it received, the sender only
checksums), 2026-12-04 21:40-22:00 UTC, 8 steps, the machine shared (load 2.7-11.9): 1.43x median
[1.18-2.43] (0.09-0.13 s without, 0.13-0.32 s with), then 1.19x [1.11-1.37] (0.10-0.13 s
without, 0.13-0.17 s with); EQUAL, 9 syncs, 10 resident parts reused a sync. The runs are not
interleaved, so the load between them is in the figure: the helper's own arithmetic for these 27
tensors is ~10 ms a sync per rank (measured alone: 8 ms received + 2 ms sent, against 7.3 + 3.3 ms
for the helper before lazy statistics), ~0.02 s of each 0.1 s sync is what the job shows.

Run: python benchmarks/bench_weights_job.py [--steps 4] [--keep]   (needs the job venv; holds the live-job lock)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRIC = "timing_s/update_weights"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, fingerprints)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_weights_sync import compare_summary

    from tests.support import live_job, vllm_cpu

    work = Path(tempfile.mkdtemp(prefix="bench-weights-job-"))
    python = vllm_cpu.venv_dir() / "bin" / "python"
    job = live_job.prepare_job(work / "job", python=python, steps=args.steps, ranks=2)
    tree = work / "tree"
    tree.mkdir()
    shutil.copytree(vllm_cpu.site_packages(python) / "verl", tree / "verl")
    subprocess.run(
        [sys.executable, "-m", "rl_msprobe", "patch", "apply", "verl-weights", "--tree", str(tree)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    folder = work / "weights"
    result: dict = {"steps": args.steps, "load_1min": [round(os.getloadavg()[0], 1)]}
    for variant, extra in (("none", {}), ("k64", {"RL_MSPROBE_WEIGHTS_DIR": str(folder)})):
        script = work / "job" / f"run_{variant}.sh"
        shutil.copyfile(job.script, script)
        run = live_job.run(job, script, pythonpath=(tree,), **extra)
        result["load_1min"].append(round(os.getloadavg()[0], 1))
        if run.returncode:
            sys.exit(
                f"the {variant} job failed (exit {run.returncode}); its log: {run.log_path}\n{run.tail(3000)}"
            )
        result[variant] = {
            "wall_s": round(run.wall_s, 1),
            METRIC: {step: m.get(METRIC) for step, m in sorted(run.metrics.items())},
            "timing_s/step": {step: m.get("timing_s/step") for step, m in sorted(run.metrics.items())},
        }
    base, with_fp = result["none"][METRIC], result["k64"][METRIC]
    ratios = [with_fp[s] / base[s] for s in base if base.get(s) and with_fp.get(s)]
    result["ratio per step"] = [round(r, 3) for r in ratios]
    result["ratio median"] = round(statistics.median(ratios), 3) if ratios else None
    result["k64_compare"] = compare_summary(folder)
    print(json.dumps(result, indent=1))
    if args.keep:
        print(f"kept: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
