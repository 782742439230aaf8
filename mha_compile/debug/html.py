"""index.html of a dump run: every graph's report, files and picture on one page.

The page is static (no script, no server): links are relative to the run folder and each
graph's SVG is inlined (so its tooltips work from file://), unless it is too large, in which
case it is linked. It is rewritten after each graph, so it is complete whenever a run stops.
"""
import html
import json
from pathlib import Path

from mha_compile.debug.picture import (ANCHOR_BORDER, MISS_BORDER, MISS_FILL, REGION_BORDER, REGION_FILL,
                                       svg_for_html)

INLINE_SVG_LIMIT = 4_000_000  # bytes; a larger picture is linked, not inlined

_STYLE = f"""
body {{ font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 22px; margin-bottom: 4px; }} h2 {{ font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 8px 0; }} td, th {{ border: 1px solid #ddd; padding: 4px 8px; \
text-align: left; vertical-align: top; font-size: 14px; }}
th {{ background: #f5f5f5; }} pre {{ background: #f7f7f7; padding: 10px; overflow-x: auto; font-size: 13px; }}
.ok {{ color: {REGION_BORDER}; font-weight: 600; }} .miss {{ color: {MISS_BORDER}; font-weight: 600; }}
.files a {{ margin-right: 14px; }} .picture {{ overflow: auto; max-height: 900px; border: 1px solid #ddd; \
background: #fff; }}
.picture svg {{ max-width: none; height: auto; }}
.legend span {{ display: inline-block; padding: 2px 8px; margin-right: 8px; border-radius: 4px; font-size: 13px; }}
"""


def write_index(run):
    """Write run/index.html from the graph folders' report.json files. Returns its path."""
    graphs = []
    for folder in sorted(Path(run).glob("graph_*")):
        try:
            graphs.append((folder, json.loads((folder / "report.json").read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue  # a graph still being written, or one whose report failed: not listed
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>mha_compile dump {html.escape(Path(run).name)}"
             f"</title><style>{_STYLE}</style></head><body>",
             f"<h1>mha_compile graph dump</h1><p>run folder <code>{html.escape(str(Path(run).resolve()))}</code>: "
             f"{len(graphs)} graph(s) in compile order.</p>",
             _legend(), _summary_table(graphs)]
    for folder, doc in graphs:
        parts.append(_graph_section(folder, doc))
    parts.append("</body></html>\n")
    path = Path(run) / "index.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _legend():
    return ("<p class='legend'>Pictures: "
            f"<span style='background:{REGION_FILL};border:2px solid {REGION_BORDER}'>replaced MHA region</span>"
            f"<span style='background:{MISS_FILL};border:2px solid {MISS_BORDER}'>"
            "near-miss: where the block differs</span>"
            f"<span style='border:2px dashed {ANCHOR_BORDER}'>top-k of a near-miss</span>"
            "Hover a box for its full name, shape and reason. Parameters and symbolic sizes are listed in "
            "their users' boxes (← name) rather than drawn.</p>")


def _summary_table(graphs):
    rows = ["<table><tr><th>graph</th><th>matches</th><th>kernels</th><th>near-misses</th><th>fallback</th></tr>"]
    for folder, doc in graphs:
        kernels = ", ".join(sorted({m["kernels"] for m in doc["matches"]})) or "–"
        rows.append(f"<tr><td><a href='#{folder.name}'>{folder.name}</a></td>"
                    f"<td class='{'ok' if doc['matches'] else ''}'>{len(doc['matches'])}</td>"
                    f"<td>{html.escape(kernels)}</td>"
                    f"<td class='{'miss' if doc['near_misses'] else ''}'>{len(doc['near_misses'])}</td>"
                    f"<td>{html.escape(doc.get('fallback') or '–')}</td></tr>")
    return "\n".join(rows) + "</table>"


def _graph_section(folder, doc):
    name = folder.name
    files = doc.get("files", {})
    links = " ".join(f"<a href='{name}/{html.escape(path)}'>{html.escape(path)}</a>"
                     for key, path in files.items() if path)
    out = [f"<h2 id='{name}'>{name}: "
           f"<span class='{'ok' if doc['matches'] else ''}'>{len(doc['matches'])} match(es)</span>, "
           f"<span class='{'miss' if doc['near_misses'] else ''}'>{len(doc['near_misses'])} near-miss(es)</span></h2>",
           f"<p class='files'>{links}</p>"]
    for i, m in enumerate(doc["matches"]):
        cfg = ", ".join(f"{k}={v}" for k, v in m["config"].items())
        shapes = ", ".join(f"{k} [{', '.join(v or [])}]" for k, v in m["shapes"].items())
        out.append(f"<p><span class='ok'>region {i}</span> at <code>{html.escape(m['output'])}</code>: kernels "
                   f"<b>{html.escape(m['kernels'])}</b> ({html.escape(m['kernels_reason'])}); {html.escape(cfg)}; "
                   f"{html.escape(shapes)}, {html.escape(m['dtype'])}; covers {len(m['nodes'])} nodes.</p>")
    if doc["near_misses"]:
        out.append("<table><tr><th>near-miss at</th><th>top-k</th><th>reason</th></tr>")
        for miss in doc["near_misses"]:
            out.append(f"<tr><td><code>{html.escape(miss['node'])}</code></td><td><code>{html.escape(miss['anchor'])}"
                       f"</code></td><td class='miss'>{html.escape(miss['reason'])}</td></tr>")
        out.append("</table>")
    if doc.get("fallback"):
        out.append(f"<p class='miss'>fallback: {html.escape(doc['fallback'])}</p>")
    out.append(_picture(folder, files.get("svg"), files.get("dot"), "captured graph"))
    if files.get("rewritten_svg") and doc["matches"]:
        out.append(f"<details><summary>rewritten graph</summary>"
                   f"{_picture(folder, files.get('rewritten_svg'), files.get('rewritten_dot'), 'rewritten graph')}"
                   "</details>")
    text = folder / files.get("text", "report.txt")
    if text.exists():
        body = html.escape(text.read_text(encoding="utf-8"))
        out.append(f"<details><summary>report.txt</summary><pre>{body}</pre></details>")
    return "\n".join(out)


def _picture(folder, svg, dot, what):
    if not svg:
        return (f"<p>No picture of the {what}: graphviz's <code>dot</code> was not available. "
                f"Render <a href='{folder.name}/{dot}'>{dot}</a> with <code>dot -Tsvg {dot} -o graph.svg</code>.</p>"
                if dot else "")
    path = folder / svg
    if path.exists() and path.stat().st_size <= INLINE_SVG_LIMIT:
        return f"<div class='picture'>{svg_for_html(path.read_text(encoding='utf-8'))}</div>"
    return f"<p><a href='{folder.name}/{svg}'>picture of the {what}</a> (too large to show inline)</p>"
