"""From triage to a dump: which step and request to dump, and the ready commands to do it.

The step: the first step whose mean |Δp| jumps (at least `JUMP` times the median of the steps
before it); without a jump, the step with the largest mean |Δp|. The request: that step's worst
(largest |Δ log p|). Its dataset row (or, lacking one, its prompt token ids) is written as a
one-prompt jsonl data file (verl's RLHF dataset reads .jsonl); with the user's launch script, a
reproduction script is derived from it (that file as train and val data, one step), ready for
`rl-msprobe prepare --mode consistency`, which sets batch sizes, dumps and patches.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_msprobe.report_folder import ReportFolder
from rl_msprobe.triage.stream import Scalar, Triage, Worst

if TYPE_CHECKING:
    from rl_msprobe.launch.script import LaunchScript

JUMP = 3.0  # a step's mean |Δp| at least this many times the median before it is a jump


@dataclass
class Growth:
    first: float
    last: float
    jump_step: Scalar = None
    jump_ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "first_mean_dp": self.first,
            "last_mean_dp": self.last,
            "jump_step": self.jump_step,
            "jump_ratio": self.jump_ratio,
        }


def growth(result: Triage) -> Growth | None:
    steps = result.step_list()
    means = [s.gaps["dp"].mean() for s in steps if "dp" in s.gaps]
    if not means:
        return None
    g = Growth(means[0], means[-1])
    for k in range(1, len(means)):
        base = statistics.median(means[:k])
        if base > 0 and means[k] >= JUMP * base and means[k] - base > 1e-6:
            g.jump_step, g.jump_ratio = steps[k].step, means[k] / base
            break
    return g


@dataclass
class Proposal:
    step: Scalar
    why: str
    request: Worst | None
    data_file: str | None = None
    script: str | None = None
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "why": self.why,
            "request": self.request.to_json() if self.request else None,
            "data_file": self.data_file,
            "script": self.script,
            "commands": self.commands,
            "notes": self.notes,
        }


def choose(result: Triage, step_worst: dict[Scalar, Worst]) -> Proposal | None:
    g = growth(result)
    steps = result.step_list()
    if g is None or not steps:
        return None
    step: Scalar
    if g.jump_step is not None:
        step = g.jump_step
        why = f"the mean |Δp| jumps at step {step} ({g.jump_ratio:.1f}x the median of the steps before)"
    else:
        top = max(steps, key=lambda s: _finite(s.gaps["dp"].mean()))
        step = top.step
        why = f"no jump (>= {JUMP:g}x) between steps: step {step} has the largest mean |Δp|"
    return Proposal(step, why, step_worst.get(step))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -1.0


def data_row(worst: Worst) -> tuple[dict[str, Any], bool]:
    """The request's dataset row for verl's RLHF dataset; False when only token ids are known."""
    sample = dict(worst.sample or {})
    prompt = sample.pop("raw_prompt", None) or sample.get("prompt")
    if prompt is not None:
        row = {"data_source": sample.get("data_source", "rl_msprobe_triage"), "prompt": prompt}
        for key in ("ability", "reward_model", "extra_info"):
            if sample.get(key) is not None:
                row[key] = sample[key]
        return row, True
    return {"data_source": "rl_msprobe_triage", "prompt_token_ids": worst.prompt_ids}, False


def write_proposal(
    proposal: Proposal,
    out: ReportFolder,
    script: Path | None,
    verl_tree: str | None,
    python: str | None = None,
) -> None:
    """Write the one-prompt data file (and the reproduction script) and fill in the commands.

    The consistency command names the training interpreter (`--python`) when it is known: a
    consistency dump patches verl and the rollout engine, and `dumps compare` runs msprobe there."""
    worst = proposal.request
    if worst is None:
        proposal.notes.append(f"no request with response tokens was logged at step {proposal.step}")
        return
    row, has_prompt = data_row(worst)
    tag = str(worst.request_id or worst.uid or f"row{worst.index}")[:12]  # ids may be numbers
    data = out.write(
        f"repro_step{_safe(str(proposal.step))}_{_safe(tag)}.jsonl",
        json.dumps(row, ensure_ascii=False) + "\n",
    )
    proposal.data_file = str(data)
    if not has_prompt:
        proposal.notes.append(
            f"{data.name} holds the prompt's token ids only (the batch carried no dataset row): decode them with the "
            "job's tokenizer into the chat messages of a `prompt` field before using it as data"
        )
    tree = target_args(verl_tree, python)
    if not tree:
        proposal.notes.append(
            "add --python PY (the interpreter that runs verl) to the prepare command: it finds verl and the rollout "
            "engine there and checks msprobe"
        )
    parsed = None
    if script is not None and isinstance(proposal.step, int) and stable_id(worst.request_id):
        # the id is stable (rl_msprobe_consistency.stable_request_id): the job itself, its batch and parallelism
        # kept, reaches the same request at the same step again; only that request is recorded
        proposal.commands.append(
            f"rl-msprobe prepare {shlex.quote(str(script))} --mode consistency --steps {proposal.step} "
            f"--request {shlex.quote(str(worst.request_id))}{tree}"
        )
    if script is not None:
        parsed = read_script(script)
        derived = write_repro_script(script, parsed, data, out, proposal.step)
        proposal.script = str(derived)
        # one prompt: the original skill's batch-1 plan fits it (a one-row dataset cannot fill the job's batch)
        proposal.commands.append(
            f"rl-msprobe prepare {shlex.quote(str(derived))} --mode consistency --batch-one{tree}"
        )
    else:
        proposal.commands.append(
            f"rl-msprobe prepare YOUR_SCRIPT --mode consistency --batch-one{tree}   # after adding "
            f"data.train_files={data} data.val_files={data} trainer.total_training_steps=1 to YOUR_SCRIPT "
            "(or pass --script to `mismatch report` to have that script written)"
        )
    if isinstance(proposal.step, int) and proposal.step > 1:
        proposal.notes.append(trained_weights_note(proposal.step, save_freq(parsed) if parsed else None))
    proposal.notes.append(
        f"the request: step {worst.step}, request id {worst.request_id or '-'}, prompt length {worst.prompt_len}, "
        f"worst position {worst.positions[0]['position'] if worst.positions else '-'}; after the consistency run: "
        "rl-msprobe dumps compare <rollout dump> <actor dump> --out <dir> shows the first diverging layer"
    )


_STABLE_ID = re.compile(r"^rlm[0-9a-f]{16}n[0-9]+$")


def stable_id(request_id: object) -> bool:
    """Whether REQUEST_ID is one a rerun sends again (`rlm<16 hex>n<k>`, docs/records.md), not verl's uuid."""
    return isinstance(request_id, str) and _STABLE_ID.match(request_id) is not None


def trained_weights_note(step: int, freq: object) -> str:
    """Step N > 1 sampled with weights trained for N-1 steps; the reproduction starts from the
    script's model. Say what that shows, and how to dump the trained weights instead: the full
    HF model verl saves under global_step_K/actor/huggingface as the model (a resume would also
    restore the dataloader position, past the one-prompt data)."""
    before = step - 1
    saved = isinstance(freq, int) and freq > 0 and before % freq == 0
    shown = freq if freq is not None else "-1, verl's default"
    how = (
        f"the triage run saved a checkpoint at step {before} (trainer.save_freq={freq}); if it holds the HF model "
        "(actor_rollout_ref.actor.checkpoint.save_contents with hf_model), "
        if saved
        else f"the triage run saved no checkpoint at step {before} (trainer.save_freq={shown}): rerun it with "
        f"trainer.save_freq={before} and actor_rollout_ref.actor.checkpoint.save_contents="
        "[model,optimizer,extra,hf_model], then "
    )
    return (
        f"step {step} ran on weights trained for {before} step(s); the reproduction starts from the script's model, "
        "so its dump shows the gap of the initial weights on this prompt: a rollout-side bug present from the start "
        f"shows there, a gap that needs trained weights may not. To dump step {step}'s weights: {how}set "
        f"actor_rollout_ref.model.path=<trainer.default_local_dir>/global_step_{before}/actor/huggingface "
        "in the reproduction script"
    )


def read_script(script: Path) -> LaunchScript:
    """The user's launch script, parsed once for the reproduction script and its save_freq."""
    from rl_msprobe import bounded, planner

    return planner.read(bounded.read_text(script, "verl launch script", bounded.LAUNCH_SCRIPT), str(script))


def save_freq(parsed: LaunchScript) -> object:
    """trainer.save_freq as the parsed launch script sets it (None: not set, verl's default -1;
    anything else verl's config would read, as the script wrote it)."""
    from rl_msprobe.launch.overrides import Overrides

    found = Overrides(parsed.command.args).get("trainer.save_freq") if parsed.command else None
    value = found.value if found is not None else None
    return int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value


def target_args(verl_tree: str | None, python: str | None) -> str:
    """Where `prepare` finds the trees: --python (verl and the rollout engine, msprobe checked)
    and/or --tree; a placeholder to fill in when neither is known."""
    if not python and not verl_tree:
        return ""  # pastes and runs as is; the note asks for --python (a <placeholder> is a bash redirection)
    args = f" --python {shlex.quote(python)}" if python else ""
    return args + (f" --tree {shlex.quote(verl_tree)}" if verl_tree else "")


def write_repro_script(
    script: Path, parsed: LaunchScript, data: Path, out: ReportFolder, step: Scalar
) -> Path:
    """A copy of the user's launch script (`parsed`: as `read_script` read it) with the one-prompt
    data and one training step."""
    from rl_msprobe.launch.overrides import Overrides
    from rl_msprobe.launch.render import Token, comment, render

    assert parsed.command is not None
    tokens = [
        Token("data.train_files", str(data), ""),
        Token("data.val_files", str(data), ""),
        Token("trainer.total_training_steps", 1, "++"),
    ]
    header = [
        comment(
            f"Derived by rl-msprobe mismatch report from {script}: the worst request of triage step {step} as the "
            "only prompt; next: rl-msprobe prepare THIS --mode consistency"
        )
    ]
    derived = render(parsed, Overrides(parsed.command.args), tokens, [], header)
    stem = script.name[:-3] if script.name.endswith(".sh") else script.name
    return out.write(f"run_repro_step{_safe(str(step))}_{_safe(stem)}.sh", derived, 0o755)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
