"""The live-job harness's own pure parts (no venv): metric parsing, the plain script, the lock."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

from tests.support import live_job

LOG = (
    "\x1b[36m(TaskRunnerV1 pid=20921)\x1b[0m step:1 - global_seqlen/min:159.0 - actor/entropy:6.21875"
    " - training/rollout_probs_diff_mean:1.8261394870933145e-05 - num_turns/min:np.int32(2)"
    " - num_turns/mean:np.float64(2.0) - critic/score/mean:nan - timing_s/step:77.19\n"
    "(TaskRunnerV1 pid=20921) Training Progress:  50%|#####     | 1/2 [01:17<01:17, 77.21s/it]\n"
    "step:2 - perf/total_num_tokens:174 - actor/pg_loss:-0.25 - note:text\n"
)


def test_metrics_are_read_from_verl_console_lines_behind_a_ray_prefix():
    metrics = live_job.parse_metrics(LOG)
    assert sorted(metrics) == [1, 2]
    assert metrics[1]["training/rollout_probs_diff_mean"] == 1.8261394870933145e-05
    assert metrics[1]["num_turns/min"] == 2.0  # np.int32(2), not the 32 of its type name
    assert metrics[1]["num_turns/mean"] == 2.0
    assert metrics[1]["timing_s/step"] == 77.19
    assert metrics[1]["critic/score/mean"] != metrics[1]["critic/score/mean"]  # nan
    assert metrics[2] == {"perf/total_num_tokens": 174.0, "actor/pg_loss": -0.25}


def test_plain_script_is_plain_verl_with_the_machine_overrides(tmp_path: Path):
    text = live_job.plain_script(tmp_path / "model", tmp_path / "data", tmp_path, steps=3, extra=("a.b=1",))
    assert "rl-msprobe" not in text and "msprobe" not in text.lower()
    args = [line.strip().rstrip(" \\") for line in text.splitlines() if line.startswith("    ")]
    keys = dict(arg.split("=", 1) for arg in args if "=" in arg)
    assert keys["trainer.total_training_steps"] == "3"
    assert keys["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert keys["trainer.device"] == "cpu"
    assert args[-2:] == ["a.b=1", '"$@"']  # extra overrides last, then the script's arguments


def test_the_lock_serialises_live_jobs(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(live_job, "lock_path", lambda: tmp_path / "live-job.lock")
    order: list[str] = []

    def second():
        with live_job.live_job_lock():
            order.append("second")

    with live_job.live_job_lock():
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first")
        with (tmp_path / "live-job.lock").open("w") as fh:  # held: a non-blocking try fails
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
    thread.join(5)
    assert held and order == ["first", "second"]


def test_the_lock_is_reentrant_in_one_thread(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(live_job, "lock_path", lambda: tmp_path / "live-job.lock")
    with live_job.live_job_lock(), live_job.live_job_lock():  # a session, then live_job.run inside it
        pass
    with live_job.live_job_lock():  # released: taken again
        pass
