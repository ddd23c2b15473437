"""Real upstream history of the patched files (git bundles in tests/data/history), walked commit by commit.

A bundle holds only the files rl-msprobe patches (plus the version file and the package
`__init__.py`), from the first supported release to the snapshot named in the README there.
`anchor_commits` picks the commits whose change can matter to a codemod: a patched file added
or removed, a top-level class added or removed, the version changed, or a diff hunk inside a
method a codemod anchors in (`REGIONS`); the sweep runs those and the newest ones.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "history"

# project -> {path: the words of the lines a codemod anchors on (a changed line holding one, or a
# top-level `class` line, marks the commit); an empty tuple: every change of the file counts}
ANCHOR_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "verl": {
        "verl/version/version": (),
        "verl/workers/engine_workers.py": ("ActorRolloutRefWorker",),
        "verl/workers/engine/fsdp/transformer_impl.py": (
            "def forward_backward_batch",
            "micro_batch",
            "self.forward_step(",
        ),
        "verl/workers/engine/megatron/transformer_impl.py": (
            "def forward_backward_batch",
            "def forward_step",
            "forward_fn(",
            "batch_iter",
        ),
        "verl/trainer/ppo/ray_trainer.py": (
            "def fit",
            "bypass_recomputing_logprobs =",
            "compute_log_prob(batch)",
        ),
        "verl/experimental/separation/ray_trainer.py": (
            "def _fit_compute_log_prob",
            "bypass_recomputing_logprobs =",
        ),
        "verl/trainer/main_ppo_sync.py": ("def _compute_old_log_prob", "bypass_recomputing_logprobs ="),
        "verl/trainer/ppo/v1/trainer_base.py": ("def _compute_old_log_prob", "bypass_recomputing_logprobs ="),
        "verl/experimental/fully_async_policy/fully_async_trainer.py": (
            "def _fit_generate",
            "_get_samples_from_queue",
        ),
        "verl/experimental/agent_loop/agent_loop.py": (
            "server.generate.remote(",
            "agent_loop.run(",
            "def _run_agent_loop",
            "def generate(",
        ),
        "verl/workers/rollout/llm_server.py": (
            "server.generate.remote(",
            "super().generate(",
            "def generate(",
        ),
        "verl/experimental/fully_async_policy/fully_async_rollouter.py": (
            "super().generate(",
            "def generate(",
        ),
        "verl/trainer/ppo/v1/agent_loop_tq.py": ("def _agent_loop_postprocess", 'field["position_ids"]'),
    },
    "vllm-ascend": {
        "vllm_ascend/worker/model_runner_v1.py": (
            "self.debugger =",
            "self.debugger.stop(",
            "_finalize_dump_data(",
            "scheduler_output",
            "def execute_model",
            "def sample_tokens",
        ),
    },
}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def clone(project: str, dest: Path) -> Path:
    """A working clone of the project's bundle (branch main), as the tree to patch."""
    subprocess.run(
        ["git", "clone", "-q", "--branch", "main", str(DATA / f"{project}.bundle"), str(dest)],
        check=True,
        capture_output=True,
    )
    git(dest, "config", "user.email", "tests@rl-msprobe")
    git(dest, "config", "user.name", "rl-msprobe tests")
    return dest


@dataclass(frozen=True)
class Commit:
    sha: str
    date: str
    subject: str


def commits(repo: Path) -> list[Commit]:
    """Every commit of main, oldest first."""
    out = git(repo, "log", "--first-parent", "--reverse", "--format=%H%x09%cs%x09%s", "main")
    return [Commit(*line.split("\t", 2)) for line in out.splitlines()]


def anchor_commits(repo: Path, project: str, history: list[Commit]) -> list[Commit]:
    """The first commit and those whose change can matter to a codemod (see the module docstring)."""
    words = ANCHOR_WORDS[project]
    log = git(repo, "log", "--first-parent", "-p", "-U0", "--format=@@@ %H", "main", "--", *words)
    marked: set[str] = set()
    sha, path = "", ""
    for line in log.splitlines():
        if line.startswith("@@@ "):
            sha, path = line[4:], ""
        elif line.startswith("diff --git "):
            path = line.split(" b/", 1)[1]
        elif line.startswith(("new file mode", "deleted file mode")) or (path in words and not words[path]):
            marked.add(sha)
        elif line[:1] in "+-" and not line.startswith(("+++", "---")):
            text = line[1:].strip()
            if text.startswith("class ") or any(word in text for word in words.get(path, ())):
                marked.add(sha)
    return [c for i, c in enumerate(history) if i == 0 or c.sha in marked]


def checkout(repo: Path, sha: str) -> None:
    git(repo, "checkout", "-q", "-f", "--detach", sha)
    for branch in git(repo, "branch", "--format=%(refname:short)", "--list", "rl-msprobe/*").split():
        git(repo, "branch", "-q", "-D", branch)


def full_cycle(repo: Path, project: str, set_names: list[str], entry_point: str | None = None) -> dict:
    """Diff, apply (branch + commit), status applied, byte-exact revert on the checked-out commit,
    in-process. Returns {"tested", "capabilities": {name: sites}, "version", "not_covered": [NotCovered
    in the tree], "entry_points": {entry point: covered}}; raises UserError on a refusal (with
    `entry_point`, also when a capability it needs has no site)."""
    from rl_msprobe import engine
    from rl_msprobe.patches import resolve_sets
    from rl_msprobe.upstream.trees import resolve_tree

    target = resolve_tree(str(repo), project)
    sets = resolve_sets(set_names)
    plan = engine.plan_apply(target, sets, entry_point)  # raises on a missing anchor or capability
    assert plan.changes, "a tree with every capability found has something to patch"
    originals = {c.path: c.before for c in plan.changes}
    result = engine.apply(target, sets, entry_point=entry_point)
    assert result.git and sorted(result.changed) == sorted(originals)
    gaps = [m for m in plan.not_covered if m.in_tree]
    assert list(result.not_covered) == gaps, "apply reports every piece left without a site"
    for change in plan.changes:
        if change.path.endswith(".py"):
            compile(change.after or b"", change.path, "exec")
    status = engine.status(target, sets)
    assert status.all_applied, [s.status.value for s in status.sets]
    listed = [m for found in status.sets for m in found.not_covered]
    assert [(m.entry_point, m.piece) for m in listed] == [(m.entry_point, m.piece) for m in gaps], (
        "never silent"
    )
    assert engine.plan_apply(target, sets).changes == [], "a second apply changes nothing"
    engine.revert(target, sets)
    for path, before in originals.items():
        now = (repo / path).read_bytes() if (repo / path).exists() else None
        assert now == before, f"{path}: not byte-exact after revert"
    caps = {c.name: list(c.sites) for reports in plan.capabilities.values() for c in reports}
    covered: dict[str, bool] = {}
    for by_entry in plan.entry_points.values():
        for name, ok in by_entry.items():
            covered[name] = covered.get(name, True) and ok
    return {
        "tested": not plan.warnings,
        "capabilities": caps,
        "version": target.version,
        "not_covered": gaps,
        "all_not_covered": plan.not_covered,
        "entry_points": covered,
        "describe": target.describe(),
    }
