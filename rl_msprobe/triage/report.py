"""report.md, report.html (PNGs embedded), PNGs and summary.json for `rl-msprobe mismatch report`.

One list of sections feeds both the markdown and the HTML. Plots need matplotlib; without it
the report says so and carries the same numbers as tables.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl_msprobe.report_folder import ReportFolder
from rl_msprobe.reporting.html import CSS, html_table
from rl_msprobe.reporting.plot import pyplot
from rl_msprobe.triage.distribution_report import DistributionResult
from rl_msprobe.triage.propose import Growth, Proposal
from rl_msprobe.triage.stream import QUANTITIES, Gap, Triage

LABEL = {"dlogp": "|Δ log p|", "dp": "|Δp|"}
POSITION_BUCKETS = 16
TOP_TOKENS = 10
MIN_TOKEN_COUNT = 3


def fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        return f"{x:.{digits}g}"
    return str(x)


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    table: tuple[list[str], list[list[str]]] | None = None
    image: str | None = None  # PNG file name
    code: list[str] = field(default_factory=list)


def step_rows(result: Triage) -> list[list[str]]:
    rows = []
    for s in result.step_list():
        row = [fmt(s.step), str(s.requests), str(s.gaps["dp"].count if "dp" in s.gaps else 0)]
        for q in QUANTITIES:
            g = s.gaps.get(q)
            row += [fmt(g.mean()), fmt(g.quantile(0.99)), fmt(g.peak)] if g else ["–"] * 3
        row.append(fmt(s.gaps["dp"].std()) if "dp" in s.gaps else "–")
        rows.append(row)
    return rows


STEP_HEAD = [
    "step",
    "requests",
    "tokens",
    "mean |Δ log p|",
    "p99 |Δ log p|",
    "max |Δ log p|",
    "mean |Δp|",
    "p99 |Δp|",
    "max |Δp|",
    "std |Δp|",
]


def position_rows(result: Triage) -> list[list[str]]:
    sums, counts = result.by_position["dp"]
    lsums, _ = result.by_position["dlogp"]
    n = len(counts)
    if not n:
        return []
    width = max(1, math.ceil(n / POSITION_BUCKETS))
    rows = []
    for a in range(0, n, width):
        c = int(counts[a : a + width].sum())
        if c:
            rows.append(
                [
                    f"{a}–{min(n, a + width) - 1}",
                    str(c),
                    fmt(float(lsums[a : a + width].sum()) / c),
                    fmt(float(sums[a : a + width].sum()) / c),
                ]
            )
    return rows


def token_rows(result: Triage) -> list[list[str]]:
    lsums, counts = result.by_token["dlogp"]
    psums, _ = result.by_token["dp"]
    if not len(counts):
        return []
    order = sorted(
        (i for i in range(len(counts)) if counts[i] >= MIN_TOKEN_COUNT),
        key=lambda i: lsums[i] / counts[i],
        reverse=True,
    )[:TOP_TOKENS]
    return [
        [str(i), str(int(counts[i])), fmt(float(lsums[i] / counts[i])), fmt(float(psums[i] / counts[i]))]
        for i in order
    ]


def worst_rows(result: Triage) -> list[list[str]]:
    rows = []
    for w in result.worst:
        where = ", ".join(
            f"{p['position']} (token {p['token_id']}: {fmt(p['dlogp'], 3)})" for p in w.positions[:3]
        )
        rows.append(
            [
                fmt(w.step),
                fmt(w.request_id or w.uid or "–"),
                fmt(w.prompt_len),
                str(w.response_len),
                fmt(w.key[0]),
                fmt(w.mean_dlogp),
                fmt(w.mean_dp),
                where or "–",
            ]
        )
    return rows


def sections(
    result: Triage,
    g: Growth | None,
    proposal: Proposal | None,
    images: dict[str, str],
    extra: list[Section] | None = None,
) -> list[Section]:
    out = [
        Section(
            "What was read",
            [
                f"{result.requests} request(s) in {len(result.steps)} step(s) from {len(result.files)} file(s), "
                f"{result.lines} line(s).",
                "|Δp| = |exp(train log p) − exp(rollout log p)| over the response tokens verl's mask counts is what "
                "verl logs as training/rollout_probs_diff_{mean,max,std} (mean = token mean over the step; each exp "
                "rounded to its tensor's dtype as verl's torch code does, bf16 included); "
                "|Δ log p| is the same gap in log space. p99 from a histogram of 64 bins per power of two (within 1.1%).",
                *(
                    [
                        f"{result.error_count} line(s) are errors the patched trainer wrote: {'; '.join(result.errors)}"
                    ]
                    if result.error_count
                    else []
                ),
                *(
                    [f"{result.bad_count} line(s) could not be read: {'; '.join(result.bad_lines)}"]
                    if result.bad_count
                    else []
                ),
                *(
                    [f"{result.nonfinite} token(s) with a non-finite log-prob were left out."]
                    if result.nonfinite
                    else []
                ),
            ],
        )
    ]
    growth_text = []
    if g is not None:
        growth_text.append(
            f"mean |Δp| {fmt(g.first)} at the first step, {fmt(g.last)} at the last"
            + (f" ({g.last / g.first:.2f}x)." if g.first > 0 else ".")
        )
        growth_text.append(
            f"The gap jumps at step {g.jump_step}: {g.jump_ratio:.1f}x the median of the steps before."
            if g.jump_step is not None
            else "No step jumps to 3x the median of the steps before it."
        )
    out.append(Section("Gap per step", growth_text, (STEP_HEAD, step_rows(result)), images.get("steps")))
    out.append(
        Section(
            "By response position",
            ["Mean gap of the tokens at each response position, in buckets."],
            (["positions", "tokens", "mean |Δ log p|", "mean |Δp|"], position_rows(result)),
            images.get("positions"),
        )
    )
    out.append(
        Section(
            "Tokens with the biggest gaps",
            [f"Token ids seen at least {MIN_TOKEN_COUNT} times, by mean |Δ log p|."],
            (["token id", "count", "mean |Δ log p|", "mean |Δp|"], token_rows(result)),
        )
    )
    out.append(
        Section(
            "Worst requests",
            [
                "By largest |Δ log p| of one token; positions are 0-based in the response (token id: |Δ log p|)."
            ],
            (
                [
                    "step",
                    "request id",
                    "prompt len",
                    "response len",
                    "max |Δ log p|",
                    "mean |Δ log p|",
                    "mean |Δp|",
                    "worst positions",
                ],
                worst_rows(result),
            ),
        )
    )
    out += extra or []  # the distribution and semantic causes (distribution_report.py)
    if proposal is not None:
        text = [f"Dump step {proposal.step}: {proposal.why}."]
        if proposal.request is not None:
            w = proposal.request
            text.append(
                f"Its worst request: {w.request_id or w.uid or '–'} (max |Δ log p| {fmt(w.key[0])}, {w.where})."
            )
        if proposal.data_file:
            text.append(f"One-prompt data file: {proposal.data_file}")
        if proposal.script:
            text.append(f"Reproduction script: {proposal.script}")
        out.append(Section("Next: a consistency dump", text + proposal.notes, code=proposal.commands))
    return out


def render_markdown(parts: list[Section]) -> str:
    lines = ["# rl-msprobe mismatch triage", ""]
    for s in parts:
        lines += [f"## {s.title}", ""]
        lines += [f"{t}\n" for t in s.text]
        if s.image:
            lines += [f"![{s.title}]({s.image})", ""]
        if s.table and s.table[1]:
            head, rows = s.table
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            lines.append("")
        if s.code:
            lines += ["```", *s.code, "```", ""]
    return "\n".join(lines)


def render_html(parts: list[Section], pngs: dict[str, bytes]) -> str:
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>rl-msprobe mismatch triage</title>",
        f"<style>{CSS}</style></head><body><h1>rl-msprobe mismatch triage</h1>",
    ]
    for s in parts:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        out += [f"<p>{html.escape(t)}</p>" for t in s.text]
        if s.image and s.image in pngs:
            data = base64.b64encode(pngs[s.image]).decode()
            out.append(f"<img alt='{html.escape(s.title)}' src='data:image/png;base64,{data}'>")
        if s.table and s.table[1]:
            out.append(html_table(*s.table))
        if s.code:
            out.append("<pre>" + html.escape("\n".join(s.code)) + "</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def plots(result: Triage) -> tuple[dict[str, str], dict[str, bytes], str | None]:
    """(section -> PNG name, PNG name -> bytes, why there are none)."""
    plt, why = pyplot()
    if plt is None:
        return {}, {}, why
    names, pngs = {}, {}
    steps = [s for s in result.step_list() if "dp" in s.gaps]
    if steps:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        xs = list(range(len(steps)))
        for ax, q in zip(axes, QUANTITIES):
            getters: tuple[tuple[str, Callable[[Gap], float]], ...] = (
                ("mean", lambda g: g.mean()),
                ("p99", lambda g: g.quantile(0.99)),
                ("max", lambda g: g.peak),
            )
            for label, get in getters:
                ax.plot(xs, [get(s.gaps[q]) for s in steps], marker="o", label=label)
            ax.set_yscale("log")
            ax.set_xticks(xs, [str(s.step) for s in steps], rotation=0 if len(xs) < 20 else 90)
            ax.set_xlabel("step")
            ax.set_title(f"{LABEL[q]} per step")
            ax.legend()
        pngs["gap_per_step.png"] = png_bytes(fig, plt)
        names["steps"] = "gap_per_step.png"
    sums, counts = result.by_position["dlogp"]
    if len(counts):
        import numpy as np

        fig, ax = plt.subplots(figsize=(10, 3.2))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        ax.plot(np.arange(len(mean)), mean, linewidth=0.8)
        ax.set_xlabel("response position")
        ax.set_ylabel("mean |Δ log p|")
        ax.set_yscale("log")
        pngs["gap_by_position.png"] = png_bytes(fig, plt)
        names["positions"] = "gap_by_position.png"
    return names, pngs, None


def png_bytes(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def summary_json(
    result: Triage,
    g: Growth | None,
    proposal: Proposal | None,
    paths: dict[str, str],
    distribution: DistributionResult | None = None,
) -> dict[str, Any]:
    return {
        "files": result.files,
        "lines": result.lines,
        "requests": result.requests,
        "error_lines": result.error_count,
        "errors": result.errors,
        "bad_lines": result.bad_count,
        "nonfinite_tokens": result.nonfinite,
        "steps": [s.to_json() for s in result.step_list()],
        "overall": {q: result.overall[q].to_json() for q in QUANTITIES},
        "growth": g.to_json() if g else None,
        "by_position": [
            dict(zip(["positions", "tokens", "mean_dlogp", "mean_dp"], r)) for r in position_rows(result)
        ],
        "top_tokens": [
            dict(zip(["token_id", "count", "mean_dlogp", "mean_dp"], r)) for r in token_rows(result)
        ],
        "worst": [w.to_json() for w in result.worst],
        "proposal": proposal.to_json() if proposal else None,
        "distribution": distribution.to_json() if distribution is not None and distribution.present else None,
        "causes": distribution.to_json()["causes"] if distribution is not None else [],
        "report": paths,
    }


def write_report(
    result: Triage,
    g: Growth | None,
    proposal: Proposal | None,
    out: ReportFolder,
    distribution: DistributionResult | None = None,
    routing: Any = None,
) -> tuple[dict[str, str], list[str]]:
    """Write everything into out (staged: in place when the command's folder commits); returns
    (name -> path, notes). ROUTING: the MoE routing comparison (triage/routing.py), if any."""
    names, pngs, why_not = plots(result)
    extra: list[Section] = []
    if distribution is not None and distribution.present:
        from rl_msprobe.triage import distribution_report

        more = distribution_report.plot(distribution, pyplot()[0])
        pngs.update(more)
        names.update({name.removesuffix(".png"): name for name in more})
        verl_dp = {s.step: s.gaps["dp"].mean() for s in result.step_list() if "dp" in s.gaps}
        extra = distribution_report.sections(distribution, verl_dp, names)
    if routing is not None:  # the MoE routing sections (triage/routing_report.py)
        from rl_msprobe.triage import routing_report

        extra = [*extra, *routing_report.parts(routing, pngs)]
    parts = sections(result, g, proposal, names, extra)
    paths = {
        "md": str(out.path / "report.md"),
        "html": str(out.path / "report.html"),
        "json": str(out.path / "summary.json"),
    }
    for name, data in pngs.items():
        paths[name] = str(out.write(name, data))
    out.write("report.md", render_markdown(parts))
    out.write("report.html", render_html(parts, pngs))
    doc = summary_json(result, g, proposal, paths, distribution)
    doc["routing"] = routing.to_json() if routing is not None else None
    out.write("summary.json", json.dumps(doc, indent=2, default=str))
    return paths, [why_not] if why_not else []
