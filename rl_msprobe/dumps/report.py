"""report.md and a self-contained report.html (plot embedded as a PNG data URI) for a compare run.

The header says the verdict (rl-msprobe's rule, dumps.judge), the noise floor it applied, the
inputs check, the TP merge and the dtypes; every pair's first divergence follows; rows are ranked
by the judgement with msprobe's own pass / warning / error beside. Without matplotlib the report
is written all the same and says, in md and html, why it has no plot.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from rl_msprobe.dumps.compare import CompareRun, PairResult, first_divergences, verdict
from rl_msprobe.dumps.correlate import Side
from rl_msprobe.dumps.judge import FLOOR_FACTOR, GAIN, Judgement
from rl_msprobe.dumps.summary import LayerPoint, Row
from rl_msprobe.reporting.html import CSS, h, html_table
from rl_msprobe.reporting.markdown import md_table
from rl_msprobe.reporting.plot import pyplot

MAX_LINES = 8  # pairs drawn one by one; beyond that, the worst and the median over pairs


def _fmt(v: float | None, digits: int = 6) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}g}"


def _row_where(r: Row) -> str:
    return f"{r.module} {r.tensor}".strip()


def dtype_line(run: CompareRun) -> str:
    """The header line on dtypes: where training and rollout differ, on matched rows."""
    pairs = run.dtype_pairs()
    if not any(r.summary and r.summary.matched_rows for r in run.results):
        return "dtypes: not known (no row was matched)"
    if not pairs:
        return "dtypes: the same on both sides in every matched row"
    shown = ", ".join(f"{k} ({n} rows)" for k, n in list(pairs.items())[:4])
    more = f", {len(pairs) - 4} more" if len(pairs) > 4 else ""
    return f"dtypes differ (training -> rollout): {shown}{more}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.3g}%"


def floor_line(run: CompareRun) -> str:
    """The header line on the rule and its noise floor."""
    floors = run.noise_floors() or {}
    shown = (
        ", ".join(f"{k} {_pct(v)}" for k, v in sorted(floors.items())) or "none applied (no module judged)"
    )
    return (
        f"noise floor (relative error of identical weights, measured on the live job): {shown}; a module "
        f"diverges when its output error exceeds {FLOOR_FACTOR:g}x the floor and {GAIN:g}x the error it received"
    )


def inputs_line(run: CompareRun) -> str:
    """The header line on input identity (token ids / positions from the integer rows)."""
    done = [r.summary for r in run.results if r.summary]
    differ = [s.input_mismatch for s in done if s.input_mismatch]
    if differ:
        return f"inputs DIFFER in {len(differ)} of {len(done)} pair(s): {differ[0]}"
    checked = sorted({w for s in done for w in s.inputs_checked})
    if not checked:
        return "inputs: not checked (no integer input row was matched)"
    return f"inputs identical in every pair ({', '.join(checked)})"


def tp_line(run: CompareRun) -> str | None:
    widths = sorted({len(r.pair.rollout_ranks) for r in run.results})
    if widths == [1]:
        return None
    merged = [n for r in run.results for n in r.notes if "TP ranks merged" in n]
    return f"rollout TP ranks per pair: {', '.join(map(str, widths))}" + (f"; {merged[0]}" if merged else "")


def header_lines(run: CompareRun) -> list[str]:
    lines = [floor_line(run), inputs_line(run), dtype_line(run)]
    tp = tp_line(run)
    return lines + ([tp] if tp else [])


def first_lines(run: CompareRun) -> list[str]:
    """Every divergent pair's first divergence, with its numbers and msprobe's own word on it."""
    out = []
    for r in run.results:
        summary = r.summary if r.status == "divergent" else None
        first = summary.first_divergence if summary else None
        if summary is None or first is None:
            continue
        j = summary.first_judgement
        numbers = (
            f"output error {_pct(j.error)} ({j.floor_ratio:.3g}x the {j.precision} floor, {j.gain:.3g}x what it "
            f"received: {_pct(j.received)})"
            if j
            else _msg(first.message)
        )
        out.append(
            f"pair {r.number} (`{r.pair.request_id}`): `{_row_where(first)}` — {numbers}; msprobe: "
            f"{first.result or '–'}"
        )
    return out


# ----------------------------------------------------------------------------------- plot
def _series(points: list[LayerPoint], attr: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for p in points:
        v = getattr(p, attr)
        if v is not None:
            xs.append(p.depth)
            ys.append(v)
    return xs, ys


def plot_png(run: CompareRun) -> tuple[bytes | None, str | None]:
    """Per-layer worst output error along depth (and, in tensor mode, the worst cosine above it),
    one line per pair; (PNG bytes, None) or (None, why there is no plot)."""
    done = [(r, s) for r in run.results if (s := r.summary) is not None and s.layers]
    if not done:
        return None, None
    plt, why = pyplot()
    if plt is None:
        return None, why
    tensor = any(s.mode == "tensor" for _, s in done)
    if tensor:  # cosine only exists in tensor mode: its panel is absent, not empty, otherwise
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.2), sharex=True, dpi=110)
    else:
        fig, ax2 = plt.subplots(1, 1, figsize=(9, 3.6), dpi=110)
        ax1 = None
    axes = (ax2,) if ax1 is None else (ax1, ax2)
    labels: dict[int, str] = {}
    for _, s in done:
        for p in s.layers:
            labels[p.depth] = p.layer
    panels = [("max_abs_err", ax2, max)] + ([("cosine", ax1, min)] if ax1 is not None else [])
    if len(done) <= MAX_LINES:
        for r, s in done:
            name = f"#{r.number} {r.pair.request_id[:16]}"
            for attr, ax, _ in panels:
                ax.plot(*_series(s.layers, attr), marker="o", ms=3, lw=1.4, label=name)
    else:
        for attr, ax, worst in panels:
            by_depth: dict[int, list[float]] = {}
            for _, s in done:
                for x, y in zip(*_series(s.layers, attr)):
                    by_depth.setdefault(x, []).append(y)
            xs = sorted(by_depth)
            ax.plot(
                xs, [worst(by_depth[x]) for x in xs], lw=1.8, color="C3", label=f"worst of {len(done)} pairs"
            )
            ax.plot(
                xs,
                [sorted(by_depth[x])[len(by_depth[x]) // 2] for x in xs],
                lw=1.2,
                color="C0",
                label="median",
            )
    for _, s in done:
        first = s.first_divergence
        if first is not None and first.layer is not None:
            for ax in axes:
                ax.axvline(first.layer, color="C3", ls="--", lw=0.8, alpha=0.6)
    if ax1 is not None:
        ax1.set_ylabel("cosine (worst output in layer)")
        ax1.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax1.legend(fontsize=7, loc="lower left")
    axes[0].set_title(f"rollout vs training, msprobe consistency compare ({run.backend})", fontsize=10)
    ax2.set_ylabel("max abs error" if tensor else "|max diff| (statistics)")
    ys = [y for _, s in done for y in _series(s.layers, "max_abs_err")[1]]
    if any(y > 0 for y in ys):
        floor = min(y for y in ys if y > 0) / 10
        ax2.set_yscale("log")
        ax2.set_ylim(bottom=floor / 2)
        for line in ax2.get_lines():  # exact zeros sit on the floor of the log axis
            line.set_ydata([max(float(y), floor) for y in line.get_ydata()])
        ax2.axhline(floor, color="grey", lw=0.6, ls=":")
        ax2.text(
            0.995,
            0.02,
            f"0 drawn at {floor:.0e}",
            ha="right",
            fontsize=7,
            color="grey",
            transform=ax2.transAxes,
        )
    if ax1 is None:
        ax2.legend(fontsize=7, loc="upper left")
    ax2.set_xlabel("depth (decoder layer; embed before, head after)")
    xs = sorted(labels)
    ax2.set_xticks(xs, [labels[x] for x in xs])
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue(), None


# --------------------------------------------------------------------------------- markdown
def _side(side: Side, dump: str | None) -> str:
    return (
        f"{side.pid}/step{side.step}/rank{side.rank}"
        if side.pid is not None
        else Path(dump or "").parent.name
    )


def _pair_line(r: PairResult) -> list[str]:
    s = r.summary
    counts = s.counts if s else {}
    first = s.first_divergence if s and r.status == "divergent" else None
    ranks = r.pair.rollout_ranks
    rollout = _side(r.pair.rollout, r.pair.rollout.dump) + (
        f" + {len(ranks) - 1} TP peer(s)" if len(ranks) > 1 else ""
    )
    return [
        str(r.number),
        f"`{r.pair.request_id}`",
        rollout,
        _side(r.pair.train, r.pair.train.dump),
        r.status,
        str(len(s.divergent)) if s else "–",
        f"{counts.get('pass', 0)} / {counts.get('warning', 0)} / {counts.get('error', 0)}" if s else "–",
        str(s.not_comparable if s else "–"),
        f"{s.matched_rows}/{len(s.rows)}, {s.coverage:.0%}" if s else "–",
        f"`{_row_where(first)}`"
        if first
        else (r.not_compared_reason or "–" if s else (r.error or "").splitlines()[0]),
    ]


PAIR_HEAD = [
    "#",
    "request id",
    "rollout pid/step/rank",
    "train pid/step/rank",
    "status",
    "rl-msprobe findings",
    "msprobe rows pass / warning / error",
    "not comparable",
    "matched rows, module coverage",
    "first divergence",
]
ROW_HEAD = [
    "pair",
    "module",
    "tensor",
    "layer",
    "rel. error",
    "received",
    "x floor",
    "x received",
    "rl-msprobe",
    "msprobe",
    "cosine",
    "msprobe message",
]


def _row_cells(number: int, r: Row, j: Judgement) -> list[str]:
    return [
        str(number),
        r.module,
        r.tensor,
        "–" if r.layer is None else str(r.layer),
        _pct(j.error),
        _pct(j.received),
        f"{j.floor_ratio:.3g}",
        f"{j.gain:.3g}",
        "DIVERGES" if j.divergent else "within",
        r.result or "–",
        _fmt(r.cosine),
        _msg(r.message),
    ]


def _msg(text: str) -> str:
    try:
        items = json.loads(text)
        if isinstance(items, list):
            return "; ".join(str(i) for i in items)
    except ValueError:
        pass
    return text


def ranked_rows(run: CompareRun, n: int = 12) -> list[tuple[int, Row, Judgement]]:
    """Module outputs over all pairs ranked by rl-msprobe's judgement: findings first (forward
    order within a pair), then by how much the output error exceeds what came in."""
    rows = [(r.number, row, j) for r in run.results if r.summary for row, j in r.summary.ranked(n)]
    rows.sort(key=lambda t: (not t[2].divergent, -t[2].gain if not t[2].divergent else t[0], t[2].index))
    return rows[:n]


RANK_TITLE = "Module outputs ranked by rl-msprobe's judgement (msprobe's own result beside)"


def set_aside(run: CompareRun) -> list[list[str]]:
    """[reason, rows over all pairs, example row] for rows not read as divergence."""
    counts: dict[str, int] = {}  # note -> rows, in the order first seen
    examples: dict[str, str] = {}  # note -> its first row
    for r in run.results:
        for row in r.summary.rows if r.summary else ():
            if row.note:
                examples.setdefault(row.note, _row_where(row))
                counts[row.note] = counts.get(row.note, 0) + 1
    return [[note, str(n), examples[note]] for note, n in sorted(counts.items(), key=lambda kv: -kv[1])]


SET_ASIDE_HEAD = ["not read as divergence because", "rows", "e.g."]
RULE = (
    "rl-msprobe judges each module's output error against the error it received and the noise floor "
    "(dumps.judge); msprobe's metrics are its own (`msprobe compare --consistent_check`), its "
    "pass / warning / error shown beside; training = msprobe NPU side (-tp), rollout = Bench side (-gp)"
)
ASIDE = (
    "rows msprobe could not pair or measure, and rows where the engines' calling conventions make the "
    "two sides different quantities, are *not read as divergence* (reasons and counts below)"
)


def render_markdown(run: CompareRun, png_name: str | None, no_plot: str | None = None) -> str:
    lines = ["# rl-msprobe dump compare", "", f"**{verdict(run)}**", ""]
    lines += [f"- {x}" for x in header_lines(run)]
    lines += [f"- backend: `{run.backend}`; {RULE}", f"- {ASIDE}"]
    firsts = first_lines(run)
    if firsts:
        lines += ["", "## First divergence, every pair", ""]
        lines += [
            f"- `{w}`: first in {len(n)} pair(s) (#{', #'.join(map(str, n))})"
            for w, n in first_divergences(run).items()
        ]
        lines += ["", *[f"- {x}" for x in firsts]]
    if png_name:
        lines += ["", "## Along depth", "", f"![per-layer error along depth]({png_name})"]
    elif no_plot:
        lines += ["", "## Along depth", "", f"No plot: {no_plot}"]
    lines += ["", "## Pairs", "", *md_table(PAIR_HEAD, [_pair_line(r) for r in run.results])]
    ranked = ranked_rows(run)
    if ranked:
        lines += [
            "",
            f"## {RANK_TITLE}",
            "",
            *md_table(ROW_HEAD, [_row_cells(n, w, j) for n, w, j in ranked]),
        ]
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        lines += ["", "## Failed compares", ""]
        for r in failed:
            lines += [f"- pair {r.number} (`{r.pair.request_id}`):", "", "```", r.error or "", "```"]
    notes = sorted({n for r in run.results for n in r.notes})
    if notes:
        lines += ["", "## What msprobe was given", "", *[f"- {n}" for n in notes]]
    if run.correlation is not None:
        c = run.correlation
        lines += ["", "## Not paired", ""]
        if c.unmatched:
            lines += md_table(
                ["request id", "side", "why"], [[u.request_id or "–", u.side, u.why] for u in c.unmatched]
            )
        else:
            lines.append("Every one-request prefill found its training micro-batch.")
        lines += ["", "Log lines by what became of them:", ""]
        lines += [f"- {k}: {v}" for k, v in sorted(c.skipped.items())]
    aside = set_aside(run)
    if aside:
        lines += ["", "## Rows not read as divergence", "", *md_table(SET_ASIDE_HEAD, aside)]
    lines += ["", f"Per-pair msprobe output (CSV, log): `{run.out / 'pairs'}`", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- html
def render_html(run: CompareRun, png: bytes | None, no_plot: str | None = None) -> str:
    ok = run.consistent
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>rl-msprobe dump compare</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>rl-msprobe dump compare</h1>",
        f"<div class='verdict {'ok' if ok else 'bad'}'>{h(verdict(run))}</div>",
        "<ul>" + "".join(f"<li>{h(x)}</li>" for x in header_lines(run)) + "</ul>",
        f"<p class='muted'>backend <code>{h(run.backend)}</code>; {h(RULE)}. {h(ASIDE.replace('*', ''))}.</p>",
    ]
    firsts = first_lines(run)
    if firsts:
        parts += ["<h2>First divergence, every pair</h2><ul>"]
        parts += [
            f"<li><code>{h(w)}</code>: first in {len(n)} pair(s) (#{h(', #'.join(map(str, n)))})</li>"
            for w, n in first_divergences(run).items()
        ]
        parts += ["</ul><ul>", *[f"<li>{h(x.replace('`', ''))}</li>" for x in firsts], "</ul>"]
    if png:
        data = base64.b64encode(png).decode()
        parts += [
            "<h2>Along depth</h2>",
            f"<img alt='per-layer error along depth' src='data:image/png;base64,{data}'>",
        ]
    elif no_plot:
        parts += ["<h2>Along depth</h2>", f"<p>No plot: {h(no_plot)}</p>"]
    parts += [
        "<h2>Pairs</h2>",
        html_table(
            PAIR_HEAD,
            [[c.strip("`") for c in _pair_line(r)] for r in run.results],
            ["divergent" if r.status != "consistent" else "" for r in run.results],
        ),
    ]
    ranked = ranked_rows(run)
    if ranked:
        parts += [
            f"<h2>{h(RANK_TITLE)}</h2>",
            html_table(
                ROW_HEAD,
                [_row_cells(n, w, j) for n, w, j in ranked],
                ["divergent" if j.divergent else "" for _, _, j in ranked],
            ),
        ]
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        parts += ["<h2>Failed compares</h2>"]
        parts += [
            f"<p>pair {r.number} <code>{h(r.pair.request_id)}</code></p><pre>{h(r.error)}</pre>"
            for r in failed
        ]
    notes = sorted({n for r in run.results for n in r.notes})
    if notes:
        parts += ["<h2>What msprobe was given</h2><ul>", *[f"<li>{h(n)}</li>" for n in notes], "</ul>"]
    if run.correlation is not None:
        c = run.correlation
        parts += ["<h2>Not paired</h2>"]
        parts += [
            html_table(
                ["request id", "side", "why"], [[u.request_id or "–", u.side, u.why] for u in c.unmatched]
            )
            if c.unmatched
            else "<p>Every one-request prefill found its training micro-batch.</p>"
        ]
        parts += [
            "<p class='muted'>Log lines: "
            + h(", ".join(f"{k}: {v}" for k, v in sorted(c.skipped.items())))
            + "</p>"
        ]
    aside = set_aside(run)
    if aside:
        parts += ["<h2>Rows not read as divergence</h2>", html_table(SET_ASIDE_HEAD, aside)]
    parts += [f"<p class='muted'>Per-pair msprobe output (CSV, log): <code>{h(run.out / 'pairs')}</code></p>"]
    parts += ["</body></html>"]
    return "\n".join(parts)


def pair_lines(run: CompareRun, limit: int = 12) -> list[str]:
    """One line per pair for the terminal (the first `limit`)."""
    out = []
    for r in run.results[:limit]:
        s = r.summary
        first = s.first_divergence if s and r.status == "divergent" else None
        j = s.first_judgement if s else None
        if first is not None:
            numbers = (
                f"error {_pct(j.error)}, {j.floor_ratio:.3g}x floor, {j.gain:.3g}x received"
                if j
                else _msg(first.message)
            )
            detail = f"first divergence {_row_where(first)} ({numbers}; msprobe: {first.result or '–'})"
        elif s is None:
            detail = _error_tail(r.error)
        else:
            detail = r.not_compared_reason or (
                f"{s.matched_rows} matched rows, {len(s.judgements)} module outputs judged, none beyond the floor "
                f"and its input's error (msprobe flagged {s.msprobe_flagged})"
            )
        tp = f" [{len(r.pair.rollout_ranks)} TP ranks]" if len(r.pair.rollout_ranks) > 1 else ""
        out.append(f"  #{r.number} {r.pair.request_id}{tp}: {r.status}; {detail}")
    if len(run.results) > limit:
        out.append(f"  ... {len(run.results) - limit} more in the report")
    return out


def _error_tail(error: str | None, lines: int = 4) -> str:
    """msprobe's own last error lines, indented under the pair line (not just where the log is)."""
    text = [x for x in (error or "").splitlines() if x.strip()]
    if len(text) <= 1:
        return text[0] if text else "failed"
    return text[0] + "".join(f"\n      {x}" for x in text[-lines:])


REPORT_FILES = ("report.md", "report.html", "summary.json", "report.png")


def write_report(run: CompareRun, force: bool = False) -> dict[str, Path]:
    """Write report.md, report.png, report.html (PNG embedded) and summary.json into run.out, only
    through files it creates there (`ReportFolder`: a user's file in the way is refused unless
    `force`, a link is replaced, never written through); a missing matplotlib costs the plot only
    (said in both reports and in `no_plot`)."""
    from rl_msprobe.report_folder import ReportFolder

    png, no_plot = plot_png(run)
    run.no_plot = no_plot
    with ReportFolder(run.out, force) as folder:
        paths = {}
        if png:
            paths["png"] = folder.write("report.png", png)
        paths["md"] = folder.write("report.md", render_markdown(run, "report.png" if png else None, no_plot))
        paths["html"] = folder.write("report.html", render_html(run, png, no_plot))
        paths["json"] = folder.write("summary.json", json.dumps(run.to_json(), indent=2, default=str))
    return {k: paths[k] for k in ("md", "html", "json", "png") if k in paths}
