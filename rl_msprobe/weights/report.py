"""The weights compare report: a terminal summary, `weights.md` and `weights.html` (no plotting
library: the per-layer picture is a table of coloured cells, one row per sync, one column per layer).
"""

from __future__ import annotations

import re
from collections import defaultdict

from rl_msprobe.report_folder import ReportFolder
from rl_msprobe.reporting.html import CSS, h, html_table
from rl_msprobe.weights.document import FindingDoc, FirstDifference, SyncSummary, TensorRow, WeightsDoc
from rl_msprobe.weights.experts import expert_text
from rl_msprobe.weights.fingerprint import delta_text

LAYER = re.compile(r"\blayers?\.(\d+)\.")
MARK = {"equal": "·", "differs": "X", "missing": "?", "not-compared": "-", "tied": "=", "not-synced": "N"}
COLOUR = {
    "equal": "#cfe8cf",
    "differs": "#f4a6a6",
    "missing": "#d9d9d9",
    "not-compared": "#ececec",
    "not-synced": "#f4b183",
    "tied": "#cfe0f4",
}
RANK = {
    "not-synced": 5,
    "differs": 4,
    "missing": 3,
    "not-compared": 2,
    "tied": 0,
    "equal": 0,
}  # tied: accounted for


def layer_of(name: str) -> str:
    match = LAYER.search(name)
    return match.group(1) if match else "other"


def _worst(rows: list[TensorRow]) -> tuple[str, str]:
    """The worst status over ROWS and the stage it is in."""
    status, stage = "equal", ""
    for row in rows:
        for s in ("received", "resident"):
            found = row[s]["status"]
            if RANK[found] > RANK[status]:
                status, stage = found, s
    return status, stage


def picture(doc: WeightsDoc) -> tuple[list[str], dict[int, dict[str, tuple[str, str]]]]:
    """Columns (layers in model order, "other" last) and sync -> layer -> (worst status, stage)."""
    cells: dict[int, dict[str, list[TensorRow]]] = defaultdict(lambda: defaultdict(list))
    for row in doc["tensors"]:
        cells[row["sync"]][layer_of(row["name"])].append(row)
    layers = sorted(
        {layer for sync in cells.values() for layer in sync},
        key=lambda s: (s == "other", int(s) if s.isdigit() else 0),
    )
    return layers, {sync: {layer: _worst(rows) for layer, rows in by.items()} for sync, by in cells.items()}


def _how(step: SyncSummary, none: str) -> str:
    """Where a sync's resident fingerprints come from: `12 loader-written, 5 parameter (9 reused)`,
    reused: taken from stage received where the helper found the bytes identical."""
    hows = ", ".join(f"{n} {k}" for k, n in sorted(step["resident_how"].items())) or none
    reused = step.get("resident_reused", 0)
    return f"{hows} ({reused} reused)" if reused else hows


def summary_lines(doc: WeightsDoc) -> list[str]:
    lines = []
    for step in doc["steps"]:
        c, how = step["counts"], _how(step, "none")
        lines.append(
            f"sync {step['sync']} (step {step['step']}): {step['verdict']}: {step['sent_tensors']} sent, "
            f"{step['model_tensors']} in the model, TP {step['tp_size']}; findings {c['differs']} differ, "
            f"{c['missing']} missing, {c['not-compared']} not compared, {c['tied']} tied; resident: {how}"
            + (
                f"; received: {step['received_reused']} reused from sent"
                + (
                    f" ({step['received_implied']} by the resident checksum)"
                    if step.get("received_implied")
                    else ""
                )
                if step.get("received_reused")
                else ""
            )
        )
    for row in doc["tensors"]:
        for stage in ("received", "resident"):
            f = row[stage]
            if f["status"] == "differs":
                lines.append(
                    f"  sync {row['sync']} {stage} differs: {row['name']}{expert_text(row['name'])} {ranks_text(f)} "
                    f"({delta_text(f)})"
                )
    for x in doc.get("not_synced", []):
        lines.append(
            f"  sync {x['sync']} NOT SYNCED: {x['name']}{expert_text(x['name'])} shape {x['shape']} on ranks {x['ranks']}: {x['why']}"
        )
    first = doc["first_difference"]
    if first:
        lines.append(
            f"first difference: sync {first['sync']} (step {first['step']}) {first['name']}"
            f"{expert_text(first['name'])}, stage {first['stage']}" + _first_text(first)
        )
    lines.append(doc["verdict"])
    return lines


def ranks_text(finding: FindingDoc | FirstDifference) -> str:
    """`rank 1 (of [0, 1])` where the faulty rank is known, else the ranks involved."""
    faulty, ranks = finding.get("faulty_ranks"), finding.get("ranks")
    if faulty:
        return f"rank{'s' * (len(faulty) > 1)} {', '.join(map(str, faulty))} (of {ranks})"
    return f"ranks {ranks}" if ranks else ""


def _first_text(first: FirstDifference) -> str:
    where = ranks_text(first) if first.get("faulty_ranks") else ""
    return f", on {where}" if where else ""


def _mark(status: str, stage: str) -> str:
    """One cell of the text picture: `X rec` for a difference at stage received, `·` for equal."""
    return MARK[status] + (f" {stage[:3]}" if status == "differs" else "")


def markdown(doc: WeightsDoc) -> str:
    layers, cells = picture(doc)
    out = [f"# Weight parity: {doc['verdict']}", "", f"Folder: `{doc['folder']}`", ""]
    out += [
        "| sync | step | verdict | sent | model | differ | missing | not compared | resident from |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["steps"]:
        c, how = s["counts"], _how(s, "-")
        out.append(
            f"| {s['sync']} | {s['step']} | {s['verdict']} | {s['sent_tensors']} | {s['model_tensors']} | "
            f"{c['differs']} | {c['missing']} | {c['not-compared']} | {how} |"
        )
    out += [
        "",
        "## Per layer (X rec / X res: differs at stage received / resident; ? missing, - not compared, = tied, · equal)",
        "",
    ]
    out.append("| sync | " + " | ".join(layers) + " |")
    out.append("|---" * (len(layers) + 1) + "|")
    for sync in sorted(cells):
        marks = [_mark(*cells[sync].get(layer, ("equal", ""))) for layer in layers]
        out.append(f"| {sync} | " + " | ".join(marks) + " |")
    findings = [
        r
        for r in doc["tensors"]
        if r["received"]["status"] != "equal" or r["resident"]["status"] not in ("equal", "tied")
    ]
    out += ["", "## Findings", ""]
    if not findings:
        out.append("Every tensor equal at every sync.")
    for row in findings:
        for stage in ("received", "resident"):
            f = row[stage]
            if f["status"] not in ("equal", "tied"):
                detail = ", ".join(f"{k} {v}" for k, v in f.items() if k != "status")
                out.append(
                    f"- sync {row['sync']} `{row['name']}`{expert_text(row['name'])} {stage}: {f['status']} ({detail})"
                )
    unwritten = doc.get("not_synced", [])
    if unwritten:
        out += ["", "## NOT SYNCED (engine tensors the sync never wrote)", ""]
        out += [
            f"- sync {x['sync']} `{x['name']}` {x['shape']} on ranks {x['ranks']}: {x['why']}"
            for x in unwritten
        ]
    first = doc["first_difference"]
    if first:
        out += [
            "",
            f"**First difference**: sync {first['sync']} (step {first['step']}), `{first['name']}`"
            f"{expert_text(first['name'])}, "
            f"stage `{first['stage']}`{_first_text(first)}.",
        ]
    return "\n".join(out) + "\n"


def html_page(doc: WeightsDoc) -> str:
    """The report as one self-contained page (the shared style of rl-msprobe's reports)."""
    layers, cells = picture(doc)
    head = "".join(f"<th>{h(layer)}</th>" for layer in layers)
    body = []
    for sync in sorted(cells):
        tds = []
        for layer in layers:
            status, stage = cells[sync].get(layer, ("equal", ""))
            tds.append(
                f'<td style="background:{COLOUR[status]}" title="{h(status)} {h(stage)}">{h(_mark(status, stage))}</td>'
            )
        body.append(f"<tr><th>sync {sync}</th>{''.join(tds)}</tr>")
    verdict = doc["verdict"]
    steps = [
        [
            str(s["sync"]),
            str(s["step"]),
            s["verdict"],
            str(s["sent_tensors"]),
            str(s["model_tensors"]),
            str(s["counts"]["differs"]),
            str(s["counts"]["missing"]),
            _how(s, "-"),
        ]
        for s in doc["steps"]
    ]
    findings = [
        [
            str(r["sync"]),
            r["name"],
            stage,
            r[stage]["status"],
            delta_text(r[stage]) or "-",
            ranks_text(r[stage]),
        ]
        for r in doc["tensors"]
        for stage in ("received", "resident")
        if r[stage]["status"] not in ("equal", "tied")
    ]
    first = doc["first_difference"]
    return (
        f"<!doctype html><meta charset=utf-8><title>rl-msprobe weights</title><style>{CSS}</style>"
        f"<h1>Weight parity</h1><p class='verdict {'ok' if verdict == 'EQUAL' else 'bad'}'>{h(verdict)}"
        + (
            f": first difference at sync {first['sync']}, <code>{h(first['name'])}</code>, stage {h(first['stage'])}"
            f"{h(_first_text(first))}"
            if first
            else ""
        )
        + "</p><h2>Per layer</h2><p class=muted>One row per sync, one cell per layer: green equal, red differs "
        "(X rec: stage received, X res: stage resident), grey missing / not compared.</p>"
        f"<table><tr><th></th>{head}</tr>{''.join(body)}</table><h2>Syncs</h2>"
        + html_table(
            ["sync", "step", "verdict", "sent", "model", "differ", "missing", "resident from"], steps
        )
        + "<h2>Findings</h2>"
        + (
            html_table(["sync", "tensor", "stage", "status", "how", "ranks"], findings)
            if findings
            else "<p>Every tensor equal at every sync.</p>"
        )
    )


def write_report(doc: WeightsDoc, out: ReportFolder) -> list[str]:
    """weights.md, weights.html and weights.json into OUT (the shared --out folder: never over a
    file rl-msprobe did not write, unless --force)."""
    import json

    texts = {
        "weights.md": markdown(doc),
        "weights.html": html_page(doc),
        "weights.json": json.dumps(doc, indent=1) + "\n",
    }
    out.claim(texts)
    return [str(out.write(name, text)) for name, text in texts.items()]
