"""report.md and a self-contained report.html (plot embedded as a PNG data URI) for a compare run."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from rl_msprobe.dumps.compare import CompareRun, PairResult
from rl_msprobe.dumps.summary import LayerPoint, Row

MAX_LINES = 8  # pairs drawn one by one; beyond that, the worst and the median over pairs


def _fmt(v: float | None, digits: int = 6) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}g}"


def _row_where(r: Row) -> str:
    return f"{r.module} {r.tensor}".strip()


def verdict(run: CompareRun) -> str:
    """One line that cannot call a compare consistent when nothing (or too little) was compared."""
    if not run.results:
        return "NO PAIRS: nothing was compared"
    n = len(run.results)
    failed = [r for r in run.results if r.status == "failed"]
    diverging = [r for r in run.results if r.status == "divergent"]
    unmatched = [r for r in run.results if r.status == "not compared"]
    if run.consistent:
        rows = sum(r.summary.matched_rows for r in run.results)  # type: ignore[union-attr]
        return f"CONSISTENT: {n} pair(s), {rows} matched row(s) compared, no row beyond msprobe's thresholds"
    parts = []
    if diverging:
        first = diverging[0].summary.first_divergence  # type: ignore[union-attr]
        parts.append(
            f"DIVERGENT: {len(diverging)} of {n} pair(s); first divergence "
            f"{_row_where(first)} (layer {first.layer if first.layer is not None else '–'})"
        )
    elif unmatched:
        parts.append(f"NOT COMPARED: {len(unmatched)} of {n} pair(s); {unmatched[0].not_compared_reason}")
    else:
        parts.append("NOT COMPARED")  # only failures: said next
    if diverging and unmatched:
        parts.append(f"{len(unmatched)} pair(s) not compared ({unmatched[0].not_compared_reason})")
    if failed:
        parts.append(f"{len(failed)} of {n} pair(s) failed to compare")
    return "; ".join(parts)


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


def first_divergent_layers(run: CompareRun) -> dict[str, int]:
    """Module of the first divergence -> number of pairs where it comes first."""
    out: dict[str, int] = {}
    for r in run.results:
        if r.summary and r.summary.first_divergence:
            m = r.summary.first_divergence.module
            out[m] = out.get(m, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------------- plot
def _series(points: list[LayerPoint], attr: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for p in points:
        v = getattr(p, attr)
        if v is not None:
            xs.append(p.depth)
            ys.append(v)
    return xs, ys


def plot_png(run: CompareRun) -> bytes | None:
    """Per-layer worst cosine and max-abs error along depth, one line per pair; PNG bytes."""
    done = [r for r in run.results if r.summary and r.summary.layers]
    if not done:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tensor = any(r.summary.mode == "tensor" for r in done)  # type: ignore[union-attr]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.2), sharex=True, dpi=110)
    labels: dict[int, str] = {}
    for r in done:
        for p in r.summary.layers:  # type: ignore[union-attr]
            labels[p.depth] = p.layer
    sim_attr = "cosine" if tensor else None
    if len(done) <= MAX_LINES:
        for r in done:
            name = f"#{r.number} {r.pair.request_id[:16]}"
            pts = r.summary.layers  # type: ignore[union-attr]
            if sim_attr:
                ax1.plot(*_series(pts, sim_attr), marker="o", ms=3, lw=1.4, label=name)
            ax2.plot(*_series(pts, "max_abs_err"), marker="o", ms=3, lw=1.4, label=name)
    else:
        for attr, ax, worst in ((sim_attr, ax1, min), ("max_abs_err", ax2, max)):
            if not attr:
                continue
            by_depth: dict[int, list[float]] = {}
            for r in done:
                for x, y in zip(*_series(r.summary.layers, attr)):  # type: ignore[union-attr]
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
    for r in done:
        first = r.summary.first_divergence  # type: ignore[union-attr]
        if first is not None:
            depth = first.layer if first.layer is not None else None
            if depth is not None:
                for ax in (ax1, ax2):
                    ax.axvline(depth, color="C3", ls="--", lw=0.8, alpha=0.6)
    if tensor:
        ax1.set_ylabel("cosine (worst output in layer)")
        ax1.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax1.legend(fontsize=7, loc="lower left")
    else:
        ax1.text(
            0.5,
            0.5,
            "statistics dumps: no cosine (dump task=tensor for it)",
            ha="center",
            transform=ax1.transAxes,
        )
    ax1.set_title(f"rollout vs training, msprobe consistency compare ({run.backend})", fontsize=10)
    ax2.set_ylabel("max abs error" if tensor else "|max diff|")
    ys = [y for r in done for y in _series(r.summary.layers, "max_abs_err")[1]]  # type: ignore[union-attr]
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
    ax2.set_xlabel("depth (decoder layer; embed before, head after)")
    xs = sorted(labels)
    ax2.set_xticks(xs, [labels[x] for x in xs])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# --------------------------------------------------------------------------------- markdown
def _pair_line(r: PairResult) -> list[str]:
    s = r.summary
    counts = s.counts if s else {}
    first = s.first_divergence if s else None
    return [
        str(r.number),
        f"`{r.pair.request_id}`",
        f"{r.pair.rollout.pid}/step{r.pair.rollout.step}/rank{r.pair.rollout.rank}"
        if r.pair.rollout.pid is not None
        else Path(r.pair.rollout.dump or "").parent.name,
        f"{r.pair.train.pid}/step{r.pair.train.step}/rank{r.pair.train.rank}"
        if r.pair.train.pid is not None
        else Path(r.pair.train.dump or "").parent.name,
        r.status,
        str(counts.get("pass", 0)),
        str(counts.get("warning", 0)),
        str(counts.get("error", 0)),
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
    "pass",
    "warning",
    "error",
    "not comparable",
    "matched rows, module coverage",
    "first divergence",
]
ROW_HEAD = ["pair", "module", "tensor", "layer", "cosine", "max abs err", "rel err", "msprobe", "message"]


def _row_cells(number: int, r: Row) -> list[str]:
    return [
        str(number),
        r.module,
        r.tensor,
        "–" if r.layer is None else str(r.layer),
        _fmt(r.cosine),
        _fmt(r.max_abs_err),
        _fmt(r.rel_err),
        r.result,
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


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    esc = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in esc),
    ]


def worst_rows(run: CompareRun, n: int = 10) -> list[tuple[int, Row]]:
    rows = [(r.number, w) for r in run.results if r.summary for w in r.summary.worst(n)]
    if any(w.cosine is not None for _, w in rows):
        rows.sort(key=lambda t: (t[1].cosine if t[1].cosine is not None else 2.0, -(t[1].max_abs_err or 0)))
    else:
        rows.sort(key=lambda t: -(t[1].max_abs_err or 0))
    return rows[:n]


def worst_title(run: CompareRun) -> str:
    """On a consistent verdict the lowest rows are still within msprobe's thresholds: the title says so."""
    if run.consistent:
        return "Lowest-scoring rows (all within msprobe's thresholds)"
    return "Worst rows"


def set_aside(run: CompareRun) -> list[list[str]]:
    """[reason, rows over all pairs, example row] for rows not read as divergence."""
    seen: dict[str, list] = {}
    for r in run.results:
        for row in r.summary.rows if r.summary else ():
            if row.note:
                entry = seen.setdefault(row.note, [0, _row_where(row)])
                entry[0] += 1
    return [[note, str(n), example] for note, (n, example) in sorted(seen.items(), key=lambda kv: -kv[1][0])]


SET_ASIDE_HEAD = ["not read as divergence because", "rows", "e.g."]


def render_markdown(run: CompareRun, png_name: str | None) -> str:
    lines = ["# rl-msprobe dump compare", "", f"**{verdict(run)}**", ""]
    lines += [
        f"- {dtype_line(run)}",
        f"- backend: `{run.backend}`; metrics and verdicts are msprobe's own "
        "(`msprobe compare --consistent_check`); training = msprobe NPU side (-tp), rollout = Bench side (-gp)",
        "- rows msprobe could not pair or measure, and rows where the engines' calling conventions make the "
        "two sides different quantities, are *not read as divergence* (reasons and counts below)",
    ]
    firsts = first_divergent_layers(run)
    if firsts:
        lines += ["", "## First divergence", ""]
        lines += [f"- `{m}`: first in {n} pair(s)" for m, n in firsts.items()]
        for r in run.results:
            if r.summary and r.summary.first_divergence:
                f = r.summary.first_divergence
                lines += [
                    "",
                    f"Pair {r.number} (`{r.pair.request_id}`): `{f.rollout_name or f.train_name}` — cosine "
                    f"{_fmt(f.cosine)}, max abs err {_fmt(f.max_abs_err)}; msprobe: {_msg(f.message) or f.result}",
                ]
                break
    if png_name:
        lines += ["", "## Along depth", "", f"![per-layer cosine and max abs error]({png_name})"]
    lines += ["", "## Pairs", "", *_md_table(PAIR_HEAD, [_pair_line(r) for r in run.results])]
    worst = worst_rows(run)
    if worst:
        lines += [
            "",
            f"## {worst_title(run)}",
            "",
            *_md_table(ROW_HEAD, [_row_cells(n, w) for n, w in worst]),
        ]
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        lines += ["", "## Failed compares", ""]
        for r in failed:
            lines += [f"- pair {r.number} (`{r.pair.request_id}`):", "", "```", r.error or "", "```"]
    if run.correlation is not None:
        c = run.correlation
        lines += ["", "## Not paired", ""]
        if c.unmatched:
            lines += _md_table(
                ["request id", "side", "why"], [[u.request_id or "–", u.side, u.why] for u in c.unmatched]
            )
        else:
            lines.append("Every one-request prefill found its training micro-batch.")
        lines += ["", "Log lines by what became of them:", ""]
        lines += [f"- {k}: {v}" for k, v in sorted(c.skipped.items())]
    aside = set_aside(run)
    if aside:
        lines += ["", "## Rows not read as divergence", "", *_md_table(SET_ASIDE_HEAD, aside)]
    lines += ["", f"Per-pair msprobe output (CSV, log): `{run.out / 'pairs'}`", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- html
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1150px;color:#1b1f23;padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.verdict{font-size:16px;font-weight:600;padding:10px 14px;border-radius:6px}
.ok{background:#e6f4ea;color:#137333}.bad{background:#fce8e6;color:#a50e0e}
table{border-collapse:collapse;width:100%;font-size:12.5px;margin:8px 0}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.divergent td{background:#fff4f2}code{font-size:12px;background:#f6f8fa;padding:1px 3px;border-radius:3px}
img{max-width:100%;border:1px solid #eee}.muted{color:#666;font-size:12.5px}
"""


def _h(text: object) -> str:
    return html.escape(str(text))


def _html_table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_h(c)}</th>" for c in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(
            f'<td class="num">{_h(c)}</td>'
            if c.replace(".", "").replace("-", "").replace("e", "").isdigit()
            else f"<td>{_h(c)}</td>"
            for c in row
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(run: CompareRun, png: bytes | None) -> str:
    ok = run.consistent
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>rl-msprobe dump compare</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>rl-msprobe dump compare</h1>",
        f"<div class='verdict {'ok' if ok else 'bad'}'>{_h(verdict(run))}</div>",
        f"<p>{_h(dtype_line(run))}</p>",
        f"<p class='muted'>backend <code>{_h(run.backend)}</code>; metrics and verdicts are msprobe's own "
        "(<code>msprobe compare --consistent_check</code>); training = NPU side (-tp), rollout = Bench side (-gp). "
        "Rows msprobe could not pair or measure, and rows where the engines' calling conventions make the two "
        "sides different quantities, are <em>not read as divergence</em> (reasons and counts at the end).</p>",
    ]
    if png:
        data = base64.b64encode(png).decode()
        parts += [
            "<h2>Along depth</h2>",
            f"<img alt='per-layer cosine and max abs error along depth' src='data:image/png;base64,{data}'>",
        ]
    firsts = first_divergent_layers(run)
    if firsts:
        parts += ["<h2>First divergence</h2><ul>"]
        parts += [f"<li><code>{_h(m)}</code>: first in {n} pair(s)</li>" for m, n in firsts.items()]
        parts += ["</ul>"]
        r = next(r for r in run.results if r.summary and r.summary.first_divergence)
        f = r.summary.first_divergence  # type: ignore[union-attr]
        parts += [
            f"<p>Pair {r.number} (<code>{_h(r.pair.request_id)}</code>): <code>{_h(f.rollout_name or f.train_name)}</code>"
            f" — cosine {_h(_fmt(f.cosine))}, max abs err {_h(_fmt(f.max_abs_err))}; msprobe: "
            f"{_h(_msg(f.message) or f.result)}</p>"
        ]
    parts += [
        "<h2>Pairs</h2>",
        _html_table(
            PAIR_HEAD,
            [[c.strip("`") for c in _pair_line(r)] for r in run.results],
            ["divergent" if r.status != "consistent" else "" for r in run.results],
        ),
    ]
    worst = worst_rows(run)
    if worst:
        parts += [
            f"<h2>{_h(worst_title(run))}</h2>",
            _html_table(
                ROW_HEAD,
                [_row_cells(n, w) for n, w in worst],
                ["divergent" if w.divergent else "" for _, w in worst],
            ),
        ]
    failed = [r for r in run.results if r.status == "failed"]
    if failed:
        parts += ["<h2>Failed compares</h2>"]
        parts += [
            f"<p>pair {r.number} <code>{_h(r.pair.request_id)}</code></p><pre>{_h(r.error)}</pre>"
            for r in failed
        ]
    if run.correlation is not None:
        c = run.correlation
        parts += ["<h2>Not paired</h2>"]
        parts += [
            _html_table(
                ["request id", "side", "why"], [[u.request_id or "–", u.side, u.why] for u in c.unmatched]
            )
            if c.unmatched
            else "<p>Every one-request prefill found its training micro-batch.</p>"
        ]
        parts += [
            "<p class='muted'>Log lines: "
            + _h(", ".join(f"{k}: {v}" for k, v in sorted(c.skipped.items())))
            + "</p>"
        ]
    aside = set_aside(run)
    if aside:
        parts += ["<h2>Rows not read as divergence</h2>", _html_table(SET_ASIDE_HEAD, aside)]
    parts += [
        f"<p class='muted'>Per-pair msprobe output (CSV, log): <code>{_h(run.out / 'pairs')}</code></p>"
    ]
    parts += ["</body></html>"]
    return "\n".join(parts)


def pair_lines(run: CompareRun, limit: int = 12) -> list[str]:
    """One line per pair for the terminal (the first `limit`)."""
    out = []
    for r in run.results[:limit]:
        first = r.summary.first_divergence if r.summary else None
        s = r.summary
        detail = (
            f"first divergence {_row_where(first)} (cosine {_fmt(first.cosine, 4)}, max abs err {_fmt(first.max_abs_err, 3)})"
            if first
            else _error_tail(r.error)
            if s is None
            else r.not_compared_reason or f"{s.matched_rows} matched rows, no row beyond msprobe's thresholds"
        )
        out.append(f"  #{r.number} {r.pair.request_id}: {r.status}; {detail}")
    if len(run.results) > limit:
        out.append(f"  ... {len(run.results) - limit} more in the report")
    return out


def _error_tail(error: str | None, lines: int = 4) -> str:
    """msprobe's own last error lines, indented under the pair line (not just where the log is)."""
    text = [x for x in (error or "").splitlines() if x.strip()]
    if len(text) <= 1:
        return text[0] if text else "failed"
    return text[0] + "".join(f"\n      {x}" for x in text[-lines:])


def write_report(run: CompareRun) -> dict[str, Path]:
    """Write report.md, report.png, report.html (PNG embedded) and summary.json into run.out."""
    run.out.mkdir(parents=True, exist_ok=True)
    png = plot_png(run)
    paths = {"md": run.out / "report.md", "html": run.out / "report.html", "json": run.out / "summary.json"}
    if png:
        paths["png"] = run.out / "report.png"
        paths["png"].write_bytes(png)
    paths["md"].write_text(render_markdown(run, "report.png" if png else None), encoding="utf-8")
    paths["html"].write_text(render_html(run, png), encoding="utf-8")
    paths["json"].write_text(json.dumps(run.to_json(), indent=2, default=str), encoding="utf-8")
    return paths
