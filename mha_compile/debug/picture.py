"""A picture of an FX graph: Graphviz DOT text, rendered to SVG when `dot` is installed.

One box per node (its name, the op it calls, its shape and dtype), an edge from each input
to its user. In a large graph, runs of nodes far from every highlight become one grey box
each (how many nodes, which ops); the full graph is then also written (graph_full.dot,
rewritten_full.dot). Parameter, buffer and symbolic-size placeholders are not drawn as boxes (a
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
PLAIN_FILL, INPUT_FILL, OUTPUT_FILL, COLLAPSED_FILL = "#ffffff", "#e3ecfa", "#f2f2f2", "#e6e6e6"
COLLAPSE_ABOVE = 120  # boxes; a larger graph with highlights shows only their neighbourhood in full
CONTEXT_HOPS = 3  # edges around a highlight that stay drawn in full
MIN_COLLAPSED = 4  # nodes in the smallest run drawn as one grey box
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
        return (f"{target.namespace}.{target._opname}"
                + ("" if target._overloadname == "default" else f".{target._overloadname}"))
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).replace("torch.ops.", "")
    return getattr(target, "__name__", str(target))


def _dtype(dtype):
    return {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}.get(dtype, str(dtype).replace("torch.", ""))


def _clip(text, width=LABEL_WIDTH):
    return text if len(text) <= width else text[: width // 2 - 1] + "…" + text[-(width // 2 - 1):]


def graph_dot(gm, title, regions=(), near_misses=(), replaced_target=None, collapse=True):
    """DOT text for gm. regions: [(label, [node names])]; near_misses: dicts anchor/node/reason.

    replaced_target: nodes calling this target (the mha::region op) are drawn green.
    collapse: in a graph of more than COLLAPSE_ABOVE boxes with something highlighted, nodes more
    than CONTEXT_HOPS edges away from every highlight are drawn as one box per connected run.
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
    drawn = [n for n in nodes if n not in folded]
    highlighted = [n for n in drawn if n.name in region_of or n.name in miss_at or n.name in anchor_of
                   or (replaced_target is not None and n.target is replaced_target)]
    group = _collapsed_groups(drawn, highlighted) if collapse and highlighted and len(drawn) > COLLAPSE_ABOVE else {}
    if group:
        title += (f"\n({len(group)} nodes far from the highlights are collapsed into grey boxes; "
                  "the _full.dot file beside this one has all)")

    out = ["digraph G {",
           f'  graph [label={_q(title)}, labelloc=t, fontname="Helvetica", fontsize=14, rankdir=TB, '
           'nodesep=0.25, ranksep=0.3, tooltip=" "];',
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.08,0.03", '
           f'fillcolor="{PLAIN_FILL}", color="#555555"];',
           '  edge [color="#777777", arrowsize=0.6];']
    body = {i: [] for i in range(len(regions))}
    loose = []
    for node in drawn:
        if node in group:
            continue
        line = "  " + _node_stmt(node, folded, region_of, miss_at, anchor_of, replaced_target)
        (body[region_of[node.name]] if node.name in region_of else loose).append(line)
    for i, (label, _) in enumerate(regions):
        out.append(f"  subgraph cluster_region_{i} {{")
        out.append(f'    graph [label={_q(_wrap(label, CLUSTER_WIDTH, lines=3))}, style="rounded,filled", '
                   f'fillcolor="{REGION_CLUSTER}", color="{REGION_BORDER}", penwidth=2, fontcolor="{REGION_BORDER}", '
                   f'fontsize=12, tooltip={_q(label)}];')
        out.extend("  " + line for line in body[i])
        out.append("  }")
    out.extend(loose)
    out.extend(_group_stmts(group))
    edges = set()
    for node in drawn:
        for source in node.all_input_nodes:
            if source not in folded:
                edge = (group.get(source, source.name), group.get(node, node.name))
                if edge[0] != edge[1] and edge not in edges:
                    edges.add(edge)
                    out.append(f"  {_q(edge[0])} -> {_q(edge[1])};")
    unplaced = [m for m in near_misses if m["node"] not in by_name or by_name[m["node"]] in folded]
    for i, miss in enumerate(unplaced):
        text = f"near-miss at {miss['node']} (top-k {miss['anchor']}):\n" + _wrap(miss["reason"])
        out.append(f'  miss_note_{i} [shape=note, label={_q(text)}, fillcolor="{MISS_FILL}", color="{MISS_BORDER}", '
                   f"tooltip={_q(miss['reason'])}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _collapsed_groups(drawn, highlighted):
    """{node: group id} for nodes more than CONTEXT_HOPS from every highlight (inputs and output stay)."""
    drawn_set = set(drawn)
    near, frontier = set(highlighted), set(highlighted)
    for _ in range(CONTEXT_HOPS):
        frontier = {m for n in frontier for m in (*n.all_input_nodes, *n.users) if m in drawn_set} - near
        near |= frontier
    far = [n for n in drawn if n not in near and n.op not in ("placeholder", "output")]
    parent = {n: n for n in far}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in far:
        for m in n.all_input_nodes:
            if m in parent:
                parent[root(m)] = root(n)
    sizes = {}
    for n in far:
        sizes[root(n)] = sizes.get(root(n), 0) + 1
    roots = {}  # runs shorter than MIN_COLLAPSED stay drawn: a grey box would hide more than it saves
    return {n: roots.setdefault(root(n), f"collapsed_{len(roots)}") for n in far if sizes[root(n)] >= MIN_COLLAPSED}


def _group_stmts(group):
    members = {}
    for node, gid in group.items():
        members.setdefault(gid, []).append(node)
    out = []
    for gid, nodes in members.items():
        counts = {}
        for n in nodes:
            what = node_info(n)[0].split(" ")[0]
            counts[what] = counts.get(what, 0) + 1
        ops = ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        label = f"… {len(nodes)} nodes\n" + _wrap(ops, lines=3)
        tooltip = f"{len(nodes)} nodes: " + ", ".join(n.name for n in nodes)
        out.append(f'  {_q(gid)} [label={_q(label)}, fillcolor="{COLLAPSED_FILL}", style="rounded,filled,dashed", '
                   f"tooltip={_q(_clip(tooltip, 2000))}];")
    return out


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
        # utf-8 whatever the locale (the labels hold arrows and √): graphviz reads utf-8
        result = subprocess.run([dot, "-Tsvg", "-o", str(svg_path)], input=dot_text, text=True, encoding="utf-8",
                                errors="replace", capture_output=True, timeout=DOT_TIMEOUT_S)
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
