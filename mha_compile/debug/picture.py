"""A picture of an FX graph: Graphviz DOT text, rendered to SVG when `dot` is installed.

One box per node (its name, the op it calls, its shape and dtype), an edge from each input
to its user. Parameter, buffer and symbolic-size placeholders are not drawn as boxes (a
real model has hundreds): each user lists them in a "← pool.key.weight" line instead.

Highlights:
- a matched MHA region: a green cluster around its nodes, labelled with the kernels chosen;
- the replacement `mha::region` call in a rewritten graph: green;
- a near-miss: the node where the candidate stops being the block is red, with the reason in
  its label and tooltip; its top-k anchor has an orange dashed border.

`dot` is not needed to write the .dot file; without it `render_svg` warns once (how to install
graphviz) and returns None. A drawing that fails or takes too long never fails a compile.
"""
import html
import logging
import re
import shutil
import subprocess
import textwrap

import torch

log = logging.getLogger("mha_compile")

REGION_FILL, REGION_BORDER, REGION_CLUSTER = "#b7e1b0", "#2e7d32", "#eef8ec"
MISS_FILL, MISS_BORDER, ANCHOR_BORDER = "#ffcdd2", "#c62828", "#ef6c00"
PLAIN_FILL, INPUT_FILL, OUTPUT_FILL = "#ffffff", "#e3ecfa", "#f2f2f2"
LABEL_WIDTH = 44  # characters per label line; longer names are shortened in the middle
CLUSTER_WIDTH = 80  # characters per line of a region's label
PARAM_LINES = 3  # lines listing the parameters a node reads
REASON_LINES = 4  # lines of a near-miss reason shown in the box (the tooltip has all of it)
DOT_TIMEOUT_S = 60
_warned = set()


def short_name(name):
    """Dynamo's placeholder names, shortened: l_self_modules_pool_modules_key_parameters_weight_ -> pool.key.weight."""
    text = re.sub(r"^[lL]_", "", name).rstrip("_")
    text = re.sub(r"^self_(modules|parameters|buffers)_", "", text)
    return re.sub(r"_(modules|parameters|buffers)_", ".", text)


def is_folded(node):
    """Placeholders drawn inside their users' labels rather than as boxes."""
    if node.op != "placeholder":
        return False
    value = node.meta.get("example_value", node.meta.get("val"))
    return (isinstance(value, (torch.nn.Parameter, torch.SymInt, int))
            or re.search(r"_(parameters|buffers)_", node.name) is not None)


def node_info(node):
    """(what it computes, shape text, dtype text) of an FX node, short enough for a label."""
    if node.op == "call_function":
        what = _target_name(node.target)
        if what == "getitem" and len(node.args) > 1:
            what = f"getitem [{node.args[1]}]"
    elif node.op == "call_method":
        what = f".{node.target}()"
    elif node.op == "call_module":
        what = f"module {node.target}"
    elif node.op == "get_attr":
        what = f"self.{node.target}"
    elif node.op == "placeholder":
        what = "input"
    else:
        what = "output"
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return what, "[" + ", ".join(str(d) for d in value.shape) + "]", _dtype(value.dtype)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return what, " ".join("[" + ",".join(str(d) for d in v.shape) + "]" for v in value), _dtype(value[0].dtype)
    if isinstance(value, (float, torch.SymFloat)):
        hint = value.node.hint if isinstance(value, torch.SymFloat) else value
        return what, str(value) if hint is None else f"{float(hint):.6g}", type(value).__name__
    if isinstance(value, (int, torch.SymInt)):
        return what, str(value), type(value).__name__
    return what, "", ""


def _target_name(target):
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}" + ("" if target._overloadname == "default" else f".{target._overloadname}")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).replace("torch.ops.", "")
    return getattr(target, "__name__", str(target))


def _dtype(dtype):
    return {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}.get(dtype, str(dtype).replace("torch.", ""))


def _clip(text, width=LABEL_WIDTH):
    return text if len(text) <= width else text[: width // 2 - 1] + "…" + text[-(width // 2 - 1):]


def graph_dot(gm, title, regions=(), near_misses=(), replaced_target=None):
    """DOT text for gm. regions: [(label, [node names])]; near_misses: dicts anchor/node/reason.

    replaced_target: nodes calling this target (the mha::region op) are drawn green.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    region_of = {}
    for i, (_, names) in enumerate(regions):
        for name in names:
            region_of.setdefault(name, i)
    miss_at, anchor_of = {}, {}
    for miss in near_misses:
        miss_at.setdefault(miss["node"], []).append(miss["reason"])
        anchor_of.setdefault(miss["anchor"], []).append(miss["reason"])
    folded = {n for n in nodes if is_folded(n)}

    out = ["digraph G {",
           f'  graph [label={_q(title)}, labelloc=t, fontname="Helvetica", fontsize=14, rankdir=TB, '
           'nodesep=0.25, ranksep=0.3, tooltip=" "];',
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.08,0.03", '
           f'fillcolor="{PLAIN_FILL}", color="#555555"];',
           '  edge [color="#777777", arrowsize=0.6];']
    body = {i: [] for i in range(len(regions))}
    loose = []
    for node in nodes:
        if node in folded:
            continue
        line = "  " + _node_stmt(node, folded, region_of, miss_at, anchor_of, replaced_target)
        (body[region_of[node.name]] if node.name in region_of else loose).append(line)
    for i, (label, _) in enumerate(regions):
        out.append(f"  subgraph cluster_region_{i} {{")
        out.append(f'    graph [label={_q(_wrap(label, CLUSTER_WIDTH, lines=3))}, style="rounded,filled", fillcolor="{REGION_CLUSTER}", '
                   f'color="{REGION_BORDER}", penwidth=2, fontcolor="{REGION_BORDER}", fontsize=12, tooltip={_q(label)}];')
        out.extend("  " + line for line in body[i])
        out.append("  }")
    out.extend(loose)
    for node in nodes:
        if node in folded:
            continue
        for source in node.all_input_nodes:
            if source not in folded:
                out.append(f"  {_q(source.name)} -> {_q(node.name)};")
    unplaced = [m for m in near_misses if m["node"] not in by_name or by_name[m["node"]] in folded]
    for i, miss in enumerate(unplaced):
        text = f"near-miss at {miss['node']} (top-k {miss['anchor']}):\n" + _wrap(miss["reason"])
        out.append(f'  miss_note_{i} [shape=note, label={_q(text)}, fillcolor="{MISS_FILL}", color="{MISS_BORDER}", '
                   f"tooltip={_q(miss['reason'])}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _node_stmt(node, folded, region_of, miss_at, anchor_of, replaced_target):
    what, shape, dtype = node_info(node)
    lines = [_clip(short_name(node.name) if node.op == "placeholder" else node.name)]
    if node.op not in ("placeholder", "output") and re.sub(r"_\d+$", "", node.name) != what.split(" ")[0]:
        lines.append(_clip(what))  # the op, unless the node's name already says it (linear_1: linear)
    if shape or dtype:
        lines.append(_clip(f"{shape} {dtype}".strip()))
    params = [short_name(n.name) for n in node.all_input_nodes if n in folded]
    if params:
        lines.append(_wrap("← " + ", ".join(params), lines=PARAM_LINES))
    tooltip = f"{node.name}: {what} {shape} {dtype}".strip()
    attrs = {}
    if node.op == "placeholder":
        attrs["fillcolor"] = INPUT_FILL
    elif node.op == "output":
        attrs["fillcolor"] = OUTPUT_FILL
    if node.name in region_of or (replaced_target is not None and node.target is replaced_target):
        attrs.update(fillcolor=REGION_FILL, color=REGION_BORDER)
    if node.name in anchor_of:
        attrs.update(color=ANCHOR_BORDER, penwidth="2.5", style="rounded,filled,dashed")
        tooltip += "\ntop-k anchor of a near-miss: " + " | ".join(anchor_of[node.name])
        lines.append("(top-k of a near-miss)")
    if node.name in miss_at:
        reasons = miss_at[node.name]
        attrs.update(fillcolor=MISS_FILL, color=MISS_BORDER, penwidth="2.5")
        lines.append("✗ near-miss: " + _wrap(reasons[0]))
        tooltip += "\nnear-miss: " + " | ".join(reasons)
    attrs["tooltip"] = tooltip
    label = "\n".join(lines)
    return f"{_q(node.name)} [label={_q(label)}, " + ", ".join(f"{k}={_q(v)}" for k, v in attrs.items()) + "];"


def _wrap(text, width=LABEL_WIDTH, lines=REASON_LINES):
    wrapped = textwrap.wrap(text, width) or [""]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines - 1] + [_clip(wrapped[lines - 1], width - 2) + " …"]
    return "\n".join(wrapped)


def _q(text):
    """A DOT double-quoted string; newlines become centred line breaks."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_binary():
    return shutil.which("dot")


def render_svg(dot_text, svg_path):
    """Render dot_text to svg_path with graphviz. Returns svg_path, or None (with a warning once)."""
    dot = dot_binary()
    if dot is None:
        _warn_once("missing", "mha_compile: graphviz's `dot` is not installed, so graph dumps hold graph.dot but "
                   "no graph.svg. Install graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew "
                   "install graphviz; conda: conda install graphviz) or render one yourself: "
                   "dot -Tsvg graph.dot -o graph.svg")
        return None
    try:
        result = subprocess.run([dot, "-Tsvg", "-o", str(svg_path)], input=dot_text, text=True,
                                capture_output=True, timeout=DOT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        _warn_once("failed", "mha_compile: graphviz could not draw a graph dump (%s); the .dot file is there", error)
        return None
    if result.returncode != 0:
        _warn_once("failed", "mha_compile: graphviz could not draw a graph dump (%s); the .dot file is there",
                   result.stderr.strip()[:500])
        return None
    return svg_path


def svg_for_html(svg_text):
    """An SVG file's text without its XML prolog and doctype, to inline in HTML."""
    start = svg_text.find("<svg")
    return svg_text[start:] if start >= 0 else html.escape(svg_text)


def _warn_once(key, message, *args):
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)
