"""The picture of a whole-response compare: judged error by position and layer, prefill and response
marked, the first divergence circled; under it, when given, the log-prob gap per response position.

The log-prob of response token k comes from the logits of the forward at position P-1+k (the
prefill's last row for k = 0, decode step k-1 after that), so gap k is drawn at that position:
a divergence that starts at position p shows in the gap of token p-P+1 on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from rl_msprobe.dumps.positions import Result
from rl_msprobe.dumps.whole_response import RequestResult
from rl_msprobe.reporting.plot import pyplot


def plot_map(result: Result, path: Path, logprob_gap: Sequence[float] | None = None) -> str | None:
    """Write PATH (png); None, or why there is no plot. Colour: log10 of the largest module
    error / noise floor of each layer at each position (0 = at the floor); LOGPROB_GAP: one
    value per response position (triage's per-token data), drawn under the map."""
    plt, why = pyplot()
    if plt is None:
        return why
    layers, grid = result.layer_map()
    if not grid or not layers:
        return "nothing was judged: no plot"
    # an exact match (error 0) is drawn at the bottom of the scale; a layer not judged stays blank
    values = [[math.nan if v is None else math.log10(max(v, 1e-3)) for v in row] for row in grid]
    columns = list(map(list, zip(*values)))  # layer x position
    rows = 2 if logprob_gap else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(max(6.0, 0.35 * len(grid) + 2), 2.2 + 0.35 * len(layers) + 1.6 * (rows - 1)),
        squeeze=False,
    )
    ax = axes[0][0]
    image = ax.imshow(
        columns, aspect="auto", origin="lower", cmap="viridis", vmin=-3, vmax=3, interpolation="nearest"
    )
    fig.colorbar(image, ax=[a[0] for a in axes], label="log10(error / noise floor)")  # one width for both
    ax.set_yticks(range(len(layers)), layers)
    spans = result.spans()
    step = max(1, len(spans) // 60)  # at most ~60 labels: a long response is drawn whole, labelled sparsely
    ticks = list(range(0, len(spans), step))
    ax.set_xticks(
        ticks,
        [
            str(spans[i][0]) if spans[i][1] - spans[i][0] == 1 else f"{spans[i][0]}-{spans[i][1] - 1}"
            for i in ticks
        ],
        fontsize=7,
    )
    if not logprob_gap:
        ax.set_xlabel("position")
    ax.set_ylabel("layer")
    boundary = next((i for i, (start, _, _) in enumerate(spans) if start >= result.prompt), None)
    if boundary is not None:
        ax.axvline(boundary - 0.5, color="white", linewidth=1.5)
        ax.text(boundary - 0.6, len(layers) - 0.6, "prefill", color="white", ha="right", va="top", fontsize=8)
        ax.text(boundary - 0.4, len(layers) - 0.6, "response", color="white", ha="left", va="top", fontsize=8)
    first = result.first
    if first is not None:
        where, judgement = first
        x = next(i for i, (start, _, _) in enumerate(spans) if start == where.start)
        label = str(judgement.layer) if judgement.layer is not None else None
        y = layers.index(label) if label in layers else 0
        ax.scatter([x], [y], s=120, facecolors="none", edgecolors="red", linewidths=2)
    ax.set_title(result.verdict()[:110], fontsize=8)
    if logprob_gap:
        gap_ax = axes[1][0]
        xs = [
            next((i for i, (a, b, _) in enumerate(spans) if a <= result.prompt - 1 + k < b), None)
            for k in range(len(logprob_gap))
        ]
        points = [(x, g) for x, g in zip(xs, logprob_gap) if x is not None]
        gap_ax.plot([x for x, _ in points], [g for _, g in points], marker=".")
        gap_ax.set_xlim(ax.get_xlim())
        gap_ax.set_ylabel("|Δ log p| of the token\npredicted here")
        gap_ax.set_xlabel("position")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None


def markdown(result: Result, image: str | None = None) -> list[str]:
    """The verdict, the map (IMAGE: its file name, when written) and one row per position span."""
    from rl_msprobe.reporting.markdown import md_table

    lines = ["# Whole-response consistency", "", f"**{result.verdict()}**", ""]
    if image:
        lines += [f"![position x layer map]({image})", ""]
    if result.uncovered:
        lines += [f"Training positions without a rollout step: {', '.join(map(str, result.uncovered))}.", ""]
    if result.not_judged:
        told = "; ".join(f"{why}: {n}" for why, n in sorted(result.not_judged.items()))
        lines += [f"Tensors not judged (per step): {told}.", ""]
    rows = []
    for p, first, worst, judged, _ in result.summaries():
        rows.append(
            [
                p.label(result.prompt),
                p.phase,
                "divergent" if first else "consistent",
                f"{first.module} {first.tensor}" if first else "–",
                f"{worst.error:.3g} ({worst.module})" if worst else "–",
                str(judged),
            ]
        )
    head = ["position", "phase", "verdict", "first divergent module", "largest error", "judged"]
    return lines + md_table(head, rows)


def logprob_gap(triage: Path, request_id: str) -> list[float] | None:
    """|training − rollout log p| per response position of one request, from triage's lines
    (`<dir>/<pid>/triage.jsonl`, the verl-triage patch set); None when no line has that id.
    An id the rollout engine suffixed (`<id>-<8 hex>`, vLLM) matches its verl id too."""
    import json

    from rl_msprobe import bounded
    from rl_msprobe.dumps.layout import walk_files

    wanted = {request_id, request_id.rsplit("-", 1)[0]}
    # triage's own files (triage.stream.LOG_NAME), found without importing triage (a layer beside this one)
    files = [triage] if triage.is_file() else list(walk_files(triage, {"triage.jsonl"}, max_depth=3))
    for path in files:
        with bounded.open_regular(path, "triage log") as f:
            for raw in bounded.lines(f, path, "triage"):
                if not any(w.encode() in raw for w in wanted):
                    continue
                try:
                    doc = json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # a line cut short (the last one of a killed run) or damaged: not this request's
                if not isinstance(doc, dict) or doc.get("request_id") not in wanted:
                    continue
                rollout, train = doc.get("rollout_log_probs"), doc.get("train_log_probs")
                if not isinstance(rollout, list) or not isinstance(train, list):
                    return None
                return [_gap(r, t) for r, t in zip(rollout, train)]
    return None


def _gap(rollout: object, train: object) -> float:
    """|train − rollout|, NaN where either is not a number a float holds."""
    if not isinstance(rollout, (int, float)) or not isinstance(train, (int, float)):
        return math.nan
    try:
        return abs(float(train) - float(rollout))
    except OverflowError:  # an integer past float's range
        return math.nan


JOB_FILES = ("positions.md", "positions.json")


def write_job(
    results: Sequence[RequestResult],
    out: Path,
    force: bool = False,
    triage: Path | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Path]:
    """`dumps positions --out`: positions.md (the job's verdict, a table of requests, then each
    request's verdict, map and positions), positions.json, and one map per request
    (positions-<n>.png), all published at once (`ReportFolder`). TRIAGE: triage's folder, for the
    log-prob gap under each map."""
    import json
    import tempfile

    from rl_msprobe.dumps.whole_response import summary
    from rl_msprobe.report_folder import ReportFolder
    from rl_msprobe.reporting.markdown import md_table

    status, verdict = summary(list(results))
    lines = ["# Whole-response consistency of the job", "", f"**{verdict}**", ""]
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    rows = [[r.request_id, r.status, _first_text(r)] for r in results]
    lines += md_table(["request", "status", "first divergence"], rows) + [""]
    images: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="rl-msprobe-maps-") as tmp:
        for n, r in enumerate(results):
            lines += [f"## Request {r.request_id}", ""]
            if r.result is None:
                lines += [f"**{r.verdict()}**", ""]
                continue
            gap = logprob_gap(triage, r.request_id) if triage is not None else None
            name = f"positions-{n}.png"
            why = plot_map(r.result, Path(tmp) / name, gap)
            if why is None:
                images[name] = (Path(tmp) / name).read_bytes()
            body = markdown(r.result, name if why is None else None)
            lines += body[2:] + ([f"No plot: {why}."] if why else []) + [""]
    doc = {
        "status": status,
        "verdict": verdict,
        "notes": list(notes),
        "requests": [r.to_json() for r in results],
    }
    with ReportFolder(out, force) as folder:
        folder.claim([*JOB_FILES, *images])
        paths = {
            "md": folder.write("positions.md", "\n".join(lines) + "\n"),
            "json": folder.write("positions.json", json.dumps(doc, indent=1) + "\n"),
        }
        for name, data in images.items():
            folder.write(name, data)
    return paths


def _first_text(r: RequestResult) -> str:
    first = r.result.first if r.result is not None else None
    if first is None:
        return "–"
    p, j = first
    return f"{p.label(r.result.prompt) if r.result else ''}: {j.module} {j.tensor}"
