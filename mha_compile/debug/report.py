"""What the backend did to each graph, as data (for JSON) and as text (for people)."""
import dataclasses
import textwrap


@dataclasses.dataclass
class GraphReport:
    """One compiled graph: its matches and near-misses (dicts from Match/NearMiss.summary())."""
    index: int
    source: str = ""  # Dynamo's compile id and where the graph's code starts (backend.graph_source)
    ended_by: str = ""  # the graph break that ended it, where one did (backend.graph_end)
    matches: list = dataclasses.field(default_factory=list)
    near_misses: list = dataclasses.field(default_factory=list)
    fallback: str | None = None  # why the graph ran unchanged, if the rewrite failed
    code_before: str = ""
    code_after: str = ""
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def replaced(self):
        """The matches the graph runs with: none where it fell back and ran as captured."""
        return [] if self.fallback else self.matches

    @property
    def name(self):
        """How warnings and reports name the graph: "graph 3 (Dynamo 0/1, forward at models.py:131)"."""
        return f"graph {self.index}" + (f" ({self.source})" if self.source else "")

    def to_json(self):
        return dataclasses.asdict(self)

    def __str__(self):
        none = " (none replaced: see the fallback)" if self.fallback and self.matches else ""
        lines = [f"{self.name}: {len(self.matches)} match(es){none}, {len(self.near_misses)} near-miss(es)"]
        if self.ended_by:
            lines.append(f"  ended by {self.ended_by}")
        for m in self.matches:
            cfg = m["config"]
            lines.append(f"  match at {m['output']}: ctx={m['ctx']} tok={m['tok']} act={cfg['act']} "
                         f"top_k={cfg['top_k']} renorm={cfg['renorm']} dtype={m['dtype']}")
            lines.append(f"    kernels: {m['kernels']} ({m['kernels_reason']})")
            lines.append(f"    CUDA graphs: {m['graphs']}")
            lines.append(f"    keeps u: {m['keep_hidden']}")
            lines.append(f"    MoE slot runs: {m['slot_runs']}")
            if m.get("empty_rows"):
                lines.append("    a row with every key masked: " + (
                    "NaN, as the spelling's plain softmax gives it (added to ctx)" if m["empty_rows"] == "nan" else
                    "attends to nothing (inv = bo), as SDPA's safe softmax gives it"))
            # wrapped: at E = 16 the loop spelling's nodes made one line of ~2000 characters (a review's)
            lines += textwrap.wrap(f"covers {len(m['nodes'])} nodes: {', '.join(m['nodes'])}", width=100,
                                   initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False,
                                   break_long_words=False)
            if m.get("transposed"):
                layouts = {"ctx": "horizon-first, [H, B, D]", "tok": "sequence-first, [N, B, D]"}
                lines.append("    takes " + " and ".join(f"{name} transposed ({layouts[name]})"
                                                        for name in m["transposed"]))
            if m.get("copied"):
                lines.append(f"    takes a copy of {' and '.join(m['copied'])}, which the op keeps for its backward: "
                             f"the caller holds it (a graph input or output) or the graph writes it in place after "
                             f"the region, where eager's ops keep none of it")
            if m.get("kept"):
                lines.append(f"    after the op, on its outputs (the router or a view of y read outside: a "
                             f"load-balancing loss, a shared expert): {', '.join(m['kept'])}")
        for miss in self.near_misses:
            lines.append(f"  near-miss at {miss['node']} (top-k {miss['anchor']}): {miss['reason']}")
        if self.fallback:
            lines.append(f"  fallback: {self.fallback}")
        return "\n".join(lines)


@dataclasses.dataclass
class ExplainReport:
    """What `mha_compile.explain` returns: every graph Dynamo handed the backend, and a note when
    there was none (explain.NO_GRAPH)."""
    graphs: list
    note: str = ""
    graph_breaks: list = dataclasses.field(default_factory=list)  # Dynamo's, while explain compiled

    @property
    def matches(self):
        """The regions replaced. A graph that fell back (its rewrite failed, its rest could not
        compile it, verify disagreed) ran as captured: its matches are not counted here (the
        graph's own `.matches` keeps them, beside its `.fallback`). They were, and a check that
        a run was lowered (tasks.require_lowered, the bench's) passed on eager's code (a review's)."""
        return [m for g in self.graphs for m in g.replaced]

    @property
    def not_replaced(self):
        """Matches of the graphs that fell back, which ran as captured (see `.matches`)."""
        return [m for g in self.graphs if not g.replaced for m in g.matches]

    @property
    def near_misses(self):
        return [m for g in self.graphs for m in g.near_misses]

    def to_json(self):
        return {"graphs": [g.to_json() for g in self.graphs], "note": self.note, "graph_breaks": self.graph_breaks}

    def __str__(self):
        unreplaced = f" ({len(self.not_replaced)} more matched, not replaced: see the fallback)" \
            if self.not_replaced else ""
        head = (f"mha_compile: {len(self.graphs)} graph(s), {len(self.matches)} match(es){unreplaced}, "
                f"{len(self.near_misses)} near-miss(es)")
        breaks = [f"Dynamo broke the graph ({len(self.graph_breaks)} reason(s)):"] if self.graph_breaks else []
        breaks += [f"  {reason}" for reason in self.graph_breaks]
        return "\n".join([head] + [str(g) for g in self.graphs] + breaks + ([self.note] if self.note else []))
