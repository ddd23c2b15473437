"""The planner commands' click options: those `detect`, `prepare` and `check` share, and
`prepare_options`, every option of `prepare` as one decorator (in the order of PrepareFlags' fields,
which `PrepareFlags(**params)` takes), so the command function stays short."""

from __future__ import annotations

import click

from rl_msprobe import mode_table as registry
from rl_msprobe.commands.common import F

tree_option = click.option(
    "--tree",
    "trees",
    multiple=True,
    metavar="T",
    help="An upstream tree (path or release:NAME==VER) whose version matters (verl, sglang, vllm-ascend); repeatable.",
)
train_backend_option = click.option(
    "--train-backend",
    type=click.Choice(["fsdp", "megatron"]),
    help="The training backend, when the script does not say.",
)
python_option = click.option(
    "--python",
    "python",
    metavar="PY",
    help="The training interpreter (may be `docker exec -i NAME python3`).",
)
model_config_option = click.option(
    "--model-config",
    "model_config",
    metavar="PATH",
    type=click.Path(dir_okay=True),
    help="Consistency: the model's config.json (or its folder) when actor_rollout_ref.model.path cannot be read "
    "here (a hub id not in the local Hugging Face cache, a path on another machine): the attention heads and "
    "layers the checks and the size estimate need.",
)
mode_option = click.option(
    "--mode",
    type=click.Choice(registry.mode_names()),
    help=registry.mode_help(),
)
hint_option = click.option(
    "--hint", metavar="TEXT", help="What you want to collect, in words (Chinese or English)."
)
command_option = click.option(
    "--command",
    "command",
    type=click.IntRange(min=1),
    metavar="N",
    help="Which verl command of the script (1 = the first) when it runs several (default: the last training job).",
)
backend_option = click.option(
    "--backend",
    type=click.Choice(["vllm", "sglang"]),
    help="The rollout engine, when the script does not say.",
)

_ZOOM = (  # consistency: msprobe mix dumps of one layer, one request, the prompt (planner/modes/zoom.py)
    click.option(
        "--zoom",
        metavar="REPORT",
        type=click.Path(dir_okay=False),
        help="Consistency: zoom on the first divergence of a `dumps positions --json` report: msprobe mix "
        "(API-level) dumps of that layer's block and that request's prompt, so msprobe's compare names the operator.",
    ),
    click.option(
        "--zoom-request", metavar="ID", help="The zoom's request id (instead of, or over, the report's)."
    ),
    click.option("--zoom-layer", type=click.IntRange(min=0), metavar="N", help="The zoom's decoder layer."),
    click.option(
        "--zoom-module",
        metavar="NAME",
        help="The divergent module (model.layers.3.mlp.down_proj): its block is dumped.",
    ),
    click.option(
        "--zoom-position",
        type=click.IntRange(min=0),
        metavar="P",
        help="The divergent position; a response (decode) position is refused, with the reason.",
    ),
)

_PREPARE = (
    click.argument("script", type=click.Path(dir_okay=False)),
    mode_option,
    hint_option,
    click.option(
        "--out",
        "out_dir",
        metavar="DIR",
        help="Where to write the derived script (default: beside the original).",
    ),
    click.option(
        "--dump-dir",
        metavar="DIR",
        help="Dump root for inference/consistency (default: DIR/msprobe_<name>/dump).",
    ),
    click.option(
        "--level",
        default="mix",
        show_default=True,
        type=click.Choice(["mix", "L0", "L1"]),
        help="msprobe level.",
    ),
    click.option(
        "--risk-level",
        default="FOCUS",
        show_default=True,
        type=click.Choice(["ALL", "FOCUS", "CORE"]),
        help="msprobe risk_level at L1 / mix: FOCUS (msprobe's own default, written explicitly) drops "
        "reshape / view / transpose / cat / to and other low-risk calls; ALL keeps every API call (a vLLM "
        "rollout dump then runs ~60x slower); CORE keeps only matmul, linear, "
        "norm, embedding and attention calls. Module rows are always dumped.",
    ),
    click.option(
        "--steps",
        metavar="1,2",
        help="Training: global_profiler.steps (default 1,2). Inference: msprobe step list (default 0). "
        "Consistency: the number of dumped training steps (default 1: the run ends after them); with "
        "--batch-one: msprobe step list (default: every step; each side counts its own dumped forwards).",
    ),
    click.option("--ranks", metavar="0,1", help="msprobe rank list (default: all ranks)."),
    click.option(
        "--task",
        type=click.Choice(["statistics", "tensor"]),
        default="statistics",
        show_default=True,
        help="msprobe dump task: statistics (max/min/mean/norm per tensor), or tensor (whole tensors: "
        "cosine and element-wise errors in dumps compare; large, use with --level L0).",
    ),
    click.option("--stages", metavar="S1,S2", help="Training stages (default: all three)."),
    backend_option,
    train_backend_option,
    click.option(
        "--pd/--no-pd", default=None, help="SGLang prefill/decode disaggregation (default: detected)."
    ),
    tree_option,
    python_option,
    command_option,
    click.option(
        "--no-env-check", is_flag=True, help="Do not check msprobe in --python first (you take the risk)."
    ),
    click.option(
        "--prefill-only",
        is_flag=True,
        help="Consistency: msprobe's prefill compare only, no per-token records (with --batch-one: no "
        "per-token record of the actor's forward over the response, DUMP_POSITIONS unset).",
    ),
    model_config_option,
    click.option(
        "--max-dump-gib",
        type=click.FloatRange(0, min_open=True),
        default=None,
        help="Consistency: refuse when the estimated dump of one dumped training step exceeds this (default 50).",
    ),
    click.option(
        "--batch-one",
        is_flag=True,
        help="Consistency: the original skill's plan (batch 1, max_num_seqs 1, rollout.n = DP, rollout TP = the "
        "devices, msprobe dumps of every rollout step) instead of keeping the job's batch and parallelism.",
    ),
    click.option(
        "--requests",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Consistency: record about N requests per dumped step (default 16, fewer when they would pass 5 GiB).",
    ),
    click.option(
        "--request",
        "request_ids",
        multiple=True,
        metavar="ID",
        help="Consistency: record exactly this request id (repeatable), e.g. triage's worst.",
    ),
    click.option("--layers", metavar="0,27", help="Consistency: record only these decoder layers."),
    click.option(
        "--modules", metavar="REGEX", help="Consistency: record only the modules whose name REGEX finds."
    ),
    click.option(
        "--from-checkpoint",
        is_flag=True,
        help="Consistency: keep the script's resume settings (trainer.resume_mode / resume_from_path) and dump "
        "the --steps after the checkpoint.",
    ),
    click.option(
        "--prefill-compare",
        is_flag=True,
        help="Consistency: also msprobe's prefill compare (PROMPTS_ONLY) beside the records; it dumps every "
        "request's prefill.",
    ),
    click.option(
        "--top-k",
        type=click.IntRange(0, 1000),
        default=20,
        show_default=True,
        help="Triage: the rollout's top-k log-probs per response position, compared with the training engine's "
        "distribution at the same positions (0: the sampled token only).",
    ),
    click.option(
        "--weights",
        "with_weights",
        is_flag=True,
        help="Also fingerprint the weights at every sync (what --mode weights does), under <dump-dir>/weights.",
    ),
    click.option(
        "--force",
        is_flag=True,
        help="Overwrite files in the way that rl-msprobe did not write (or that were edited).",
    ),
    *_ZOOM,
)


def prepare_options(func: F) -> F:
    """Apply every option of `prepare` (the first listed is the outermost, as when stacked)."""
    for option in reversed(_PREPARE):
        func = option(func)
    return func
