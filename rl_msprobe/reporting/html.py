"""The self-contained HTML of rl-msprobe's reports: one style sheet, escaped tables."""

from __future__ import annotations

import html

CSS = """
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


def h(text: object) -> str:
    return html.escape(str(text))


def _numeric(cell: str) -> bool:
    return cell.replace(".", "").replace("-", "").replace("e", "").replace("%", "").replace("×", "").isdigit()


def html_table(head: list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    """A table with escaped cells; numbers right-aligned; CLASSES per row (e.g. 'divergent')."""
    out = ["<table><tr>" + "".join(f"<th>{h(c)}</th>" for c in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(f'<td class="num">{h(c)}</td>' if _numeric(c) else f"<td>{h(c)}</td>" for c in row)
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)
