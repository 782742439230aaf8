"""Graph dumps: every file exists and parses, the scripts reproduce the graph, the picture marks
the region and the near-misses, runs never clobber each other, bad folders never fail a compile."""
import ast
import json
import logging
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from mha_compile import models
from mha_compile.debug import dump, picture

sys.path.insert(0, str(Path(__file__).parents[1] / "lowering"))
from near_misses import NEAR_MISSES  # noqa: E402
from numerics import observing  # noqa: E402

HAS_DOT = picture.dot_binary() is not None
SVG = "{http://www.w3.org/2000/svg}"
MISS = "pool scale 1/Dh"
# report.json's fields, as documented in mha_compile/debug/dump.py and debug/README.md
FIELDS = {"schema", "index", "run", "options", "matches", "near_misses", "fallback", "inputs", "nodes",
          "node_count", "files", "code_before", "code_after"}
MATCH_FIELDS = {"output", "ctx", "tok", "nodes", "config", "params", "kernels", "kernels_reason", "graphs", "shapes",
                "dtype"}
MISS_FIELDS = {"anchor", "node", "reason", "target", "shape", "dtype"}
NODE_FIELDS = {"name", "op", "target", "shape", "dtype", "region", "near_miss"}


def _compile(model, inputs, **options):
    """Compile with backend="mha", run once; returns (output, [(report, captured gm, lowered gm)])."""
    seen = []
    with observing(lambda *graph: seen.append(graph)):
        torch._dynamo.reset()
        out = torch.compile(model, backend="mha", options=options)(*inputs)
    return out, seen


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, generator=gen), torch.randn(4, 5, 32, generator=gen)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """One run folder with two graphs: the block (one match) and a near-miss (no match)."""
    root = tmp_path_factory.mktemp("dump")
    torch.manual_seed(0)
    _, block = _compile(models.MHABlock(32, 2, 64, 4, 2), _inputs(1), dump=str(root))
    _, miss = _compile(NEAR_MISSES[MISS][0](), _inputs(2), dump=str(root))
    (run,) = root.glob("run-*")
    folder = lambda seen: run / f"graph_{seen[0][0].index:03d}"  # noqa: E731
    return {"run": run, "block": (folder(block), *block[0]), "miss": (folder(miss), *miss[0])}


def _documented(row):
    """The backticked names of debug/README.md's report.json row `row` (its first cell's name)."""
    text = Path(dump.__file__).with_name("README.md").read_text()
    section = text[text.index("## report.json"):]
    line = next(line for line in section.splitlines() if line.startswith(f"| `{row}"))
    return set(re.findall(r"`([a-z_]+)", line))


def test_report_json_s_every_field_is_documented(dumped):
    """The README's table left out source, ended_by, files' replayed and five fields of a match (a
    review's): every field a dump writes is named there now."""
    doc = _doc(dumped["block"][0])
    section = Path(dump.__file__).with_name("README.md").read_text().split("## report.json")[1]
    first_cells = re.findall(r"^\| ([^|]+) \|", section, flags=re.M)
    rows = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)", cell)}
    assert set(doc) <= rows, set(doc) - rows
    assert set(doc["matches"][0]) <= _documented("matches"), set(doc["matches"][0]) - _documented("matches")
    miss = _doc(dumped["miss"][0])["near_misses"][0]
    assert set(miss) <= _documented("near_misses"), set(miss) - _documented("near_misses")
    assert set(doc["files"]) <= _documented("files"), set(doc["files"]) - _documented("files")


def _doc(folder):
    return json.loads((folder / "report.json").read_text())


def test_every_file_exists_and_parses(dumped):
    folder, report, gm, lowered = dumped["block"]
    doc = _doc(folder)
    assert set(doc) >= FIELDS and doc["schema"] == dump.SCHEMA and doc["run"] == dumped["run"].name
    (match,) = doc["matches"]
    assert set(match) >= MATCH_FIELDS and match["kernels"] == "reference" and match["kernels_reason"]
    assert match["shapes"] == {"ctx": ["4", "3", "32"], "tok": ["4", "5", "32"], "out": ["4", "3", "32"]}
    assert match["dtype"] == "torch.float32"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert all(set(n) >= NODE_FIELDS for n in doc["nodes"])
    assert len(nodes) == len(gm.graph.nodes) == doc["node_count"]["captured"]
    assert {name for name, n in nodes.items() if n["region"] == 0} == set(match["nodes"])
    assert nodes["topk"]["target"] == "topk" and nodes["topk"]["shape"] == "[12,2] [12,2]"
    tok = next(i for i in doc["inputs"] if i["name"] == "l_tok_")
    assert tok["kind"] == "tensor" and tok["shape"] == [4, 5, 32] and tok["dtype"] == "float32"
    assert doc["node_count"]["rewritten"] == len(lowered.graph.nodes) < len(gm.graph.nodes)
    for key, name in doc["files"].items():
        # replayed.py only where a pool runs outside the CUDA graphs (tests/backend/test_whole_graph.py)
        assert name is not None or (key.endswith("svg") and not HAS_DOT) or key.endswith("_full") or \
            key == "replayed", key
        assert name is None or (folder / name).is_file(), name
    for script in ("captured.py", "rewritten.py"):
        ast.parse((folder / script).read_text())
    assert "import mha_compile.ops" in (folder / "rewritten.py").read_text()
    assert "torch.ops.mha.region.default(" in (folder / "rewritten.py").read_text()
    text = (folder / "report.txt").read_text()
    assert "1 match(es)" in text and "kernels: reference" in text and "l_tok_: [4, 5, 32] float32" in text


def test_index_links_every_file_relatively(dumped):
    links = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            links.extend(value for key, value in attrs if key == "href" and not value.startswith("#"))

    page = (dumped["run"] / "index.html").read_text()
    Links().feed(page)
    for folder, *_ in (dumped["block"], dumped["miss"]):
        for name in filter(None, _doc(folder)["files"].values()):
            assert f"{folder.name}/{name}" in links
    assert links and all(not link.startswith(("/", "http", "file:")) for link in links)
    assert all((dumped["run"] / link).is_file() for link in links)
    assert page.count("<svg") == (3 if HAS_DOT else 0)  # both captured graphs, the block's rewritten one


def test_dumped_scripts_reproduce_the_graph(dumped, tmp_path):
    folder, report, gm, lowered = dumped["block"]
    runs = {stem: subprocess.Popen([sys.executable, str(folder / f"{stem}.py"), "--seed", "3", "--save",
                                    str(tmp_path / f"{stem}.pt")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for stem in ("captured", "rewritten")}
    for stem, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        assert "output 0: shape [4, 3, 32] dtype torch.float32" in stdout
    captured = torch.load(tmp_path / "captured.pt")
    rewritten = torch.load(tmp_path / "rewritten.pt")
    inputs = captured["inputs"]
    assert [tuple(x.shape) for x in inputs] == [tuple(n.meta["example_value"].shape)
                                                for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(torch.equal(a, b) for a, b in zip(inputs, rewritten["inputs"]))  # same seed, same inputs
    with torch.no_grad():
        expected, replaced = gm(*inputs), lowered(*inputs)
    assert torch.equal(captured["outputs"][0], expected[0])
    assert torch.equal(rewritten["outputs"][0], replaced[0])
    error = (rewritten["outputs"][0] - expected[0]).norm() / expected[0].norm()
    assert error < 1e-5, error  # the replaced region computes the captured one


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = models.MHABlock(32, 2, 64, 4, 2)

    def forward(self, ctx, tok):
        return torch.utils.checkpoint.checkpoint(self.block, ctx, tok, use_reentrant=False)


def test_the_scripts_of_a_checkpointed_block_run_and_agree(tmp_path):
    """The block inside torch.utils.checkpoint: the scripts wrote its body as a plain module, and
    the checkpoint op, which reads the body's graph and meta, raised in both (a review's)."""
    torch.manual_seed(0)
    _, seen = _compile(_Checkpointed(), _inputs(9), dump=str(tmp_path))
    assert len(seen) == 1 and len(seen[0][0].matches) == 1 and seen[0][0].matches[0]["graph"] != "<top>"
    (folder,) = tmp_path.glob("run-*/graph_*")
    saved = {}
    for stem in ("captured", "rewritten"):
        proc = subprocess.run([sys.executable, str(folder / f"{stem}.py"), "--seed", "3", "--save",
                               str(tmp_path / f"{stem}.pt")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved[stem] = torch.load(tmp_path / f"{stem}.pt")
    want, got = saved["captured"]["outputs"][0], saved["rewritten"]["outputs"][0]
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.skipif(not HAS_DOT, reason="graphviz's dot is not installed")
def test_svg_highlights_the_region(dumped):
    folder, report, gm, lowered = dumped["block"]
    root = ET.parse(folder / "graph.svg").getroot()
    clusters = [g.findtext(f"{SVG}title") for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"]
    assert clusters == ["cluster_region_0"]
    fills = {g.findtext(f"{SVG}title"): _fill(g) for g in root.iter(f"{SVG}g") if g.get("class") == "node"}
    drawn = [n.name for n in gm.graph.nodes if not picture.is_folded(n)]
    region = set(report.matches[0]["nodes"])
    assert set(fills) == set(drawn)
    assert {name for name, fill in fills.items() if fill == picture.REGION_FILL} == region & set(drawn)
    assert {"topk", "attn", "inv", "y"} <= region & set(drawn)
    rewritten = ET.parse(folder / "rewritten.svg").getroot()
    fills = {g.findtext(f"{SVG}title"): _fill(g) for g in rewritten.iter(f"{SVG}g") if g.get("class") == "node"}
    assert fills["region_default"] == picture.REGION_FILL


def _fill(node_group):
    shape = node_group.find(f".//{SVG}path")
    shape = shape if shape is not None else node_group.find(f".//{SVG}polygon")
    return shape.get("fill")


def test_near_miss_reason_in_text_json_and_picture(dumped):
    folder, report, gm, lowered = dumped["miss"]
    doc = _doc(folder)
    (miss,) = doc["near_misses"]
    assert set(miss) >= MISS_FIELDS and NEAR_MISSES[MISS][1] in miss["reason"] and not doc["matches"]
    assert miss["node"] == "attn" and miss["target"] == "softmax" and miss["shape"] == "[4, 2, 5]"
    assert next(n for n in doc["nodes"] if n["name"] == "attn")["near_miss"] == miss["reason"]
    assert miss["reason"] in (folder / "report.txt").read_text()
    dot = (folder / "graph.dot").read_text()
    assert "✗ near-miss: attn: scores are scaled by" in dot and picture.MISS_FILL in dot
    if HAS_DOT:
        root = ET.parse(folder / "graph.svg").getroot()
        node = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "node" and g.findtext(f"{SVG}title") == "attn")
        assert _fill(node) == picture.MISS_FILL
        tooltip = " ".join(a.get("{http://www.w3.org/1999/xlink}title", "") for a in node.iter(f"{SVG}a"))
        assert miss["reason"] in tooltip
        assert "near-miss: attn: scores are scaled" in " ".join(t.text or "" for t in node.iter(f"{SVG}text"))


def test_large_graph_picture_collapses_what_is_far_from_the_highlights():
    def chain(x):
        for _ in range(150):
            x = torch.relu(x) + 1
        return torch.softmax(x, -1)

    gm = torch.fx.symbolic_trace(chain)
    names = [n.name for n in gm.graph.nodes]
    region = names[-4:-1]  # the last add, relu... and the softmax
    dot = picture.graph_dot(gm, "big", regions=[("region", region)])
    boxes = [line for line in dot.splitlines() if "[label=" in line and "graph [" not in line]
    assert len(boxes) < 20 and "collapsed_0" in dot and "… 29" in dot and "relu ×" in dot
    assert all(f'"{name}" [label=' in dot for name in region)
    full = picture.graph_dot(gm, "big", regions=[("region", region)], collapse=False)
    assert "collapsed_" not in full and all(f'"{name}" [label=' in full for name in names)


def test_without_dot_the_dump_has_the_dot_file_and_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(picture, "dot_binary", lambda: None)
    monkeypatch.setattr(picture, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        _compile(models.MHABlock(32, 2, 64, 4, 2), _inputs(4), dump=str(tmp_path))
        _compile(NEAR_MISSES[MISS][0](), _inputs(5), dump=str(tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "apt-get install graphviz" in warnings[0], warnings
    (run,) = tmp_path.glob("run-*")
    for folder in run.glob("graph_*"):
        assert (folder / "graph.dot").is_file() and not (folder / "graph.svg").exists()
        assert _doc(folder)["files"]["svg"] is None
    assert "dot -Tsvg graph.dot -o graph.svg" in (run / "index.html").read_text()


def test_a_verify_fallback_is_written_into_the_dump(tmp_path, monkeypatch):
    """verify decides at the first call, after the dump was written at compile time, and the dump
    went on saying the region was replaced (found by a read-through). Its report, its pictures'
    titles and the run's index now say the fallback; the files it lists stay."""
    from mha_compile.kernels import reference
    right = reference.region_forward
    monkeypatch.setattr(reference, "region_forward", lambda *a: (right(*a)[0] * 1.2, *right(*a)[1:]))
    torch.manual_seed(0)
    _, seen = _compile(models.MHABlock(32, 2, 64, 4, 2), _inputs(8), dump=str(tmp_path), verify=True)
    (run,) = tmp_path.glob("run-*")
    folder = run / f"graph_{seen[0][0].index:03d}"
    doc = _doc(folder)
    assert "verify: the rewritten graph disagrees" in doc["fallback"] and doc["files"]["captured"] == "captured.py"
    assert "none replaced" in (folder / "report.txt").read_text()
    for picture_file in ("graph.dot", "rewritten.dot"):
        assert "matched, none replaced" in (folder / picture_file).read_text(), picture_file
    assert "verify: the rewritten graph disagrees" in (run / "index.html").read_text()


@pytest.mark.parametrize("bad", ["file", "unwritable"])
def test_bad_dump_folder_warns_once_and_compiles(bad, tmp_path, caplog):
    if bad == "file":
        target = tmp_path / "not_a_folder"
        target.write_text("a file")
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write anywhere")
        target = tmp_path / "locked"
        target.mkdir(mode=0o500)
    model = models.MHABlock(32, 2, 64, 4, 2)
    inputs = _inputs(6)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        out, _ = _compile(model, inputs, dump=str(target))
        _compile(NEAR_MISSES[MISS][0](), _inputs(7), dump=str(target))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(target) in warnings[0] and "compiling without dumps" in warnings[0], warnings
    with torch.no_grad():
        assert torch.allclose(out, model(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["nul\0byte", "lone\ud800surrogate"])
def test_a_dump_path_the_os_refuses_warns_and_compiles(name, tmp_path, caplog):
    """A path with a NUL byte or a lone surrogate raised ValueError, not OSError, out of the user's
    compile (BackendCompilerFailed), naming no dump (a review's)."""
    model = models.MHABlock(32, 2, 64, 4, 2)
    inputs = _inputs(8)
    with caplog.at_level(logging.WARNING, logger="mha_compile"):
        out, seen = _compile(model, inputs, dump=str(tmp_path / name))
    assert len(seen) == 1 and len(seen[0][0].matches) == 1
    assert [r for r in caplog.records if "cannot write graph dumps" in r.getMessage()]
    with torch.no_grad():
        assert torch.allclose(out, model(*inputs), rtol=1e-5, atol=1e-6)


_ASCII_CHILD = """
import sys, torch
sys.path[:0] = sys.argv[2:]
from near_misses import NEAR_MISSES
from mha_compile import models
torch.manual_seed(0)
for model in (models.MHABlock(32, 2, 64, 4, 2), NEAR_MISSES[%r][0]()):
    torch._dynamo.reset()
    torch.compile(model, backend="mha", options={"dump": sys.argv[1]})(torch.randn(4, 3, 32), torch.randn(4, 5, 32))
print("compiled")
""" % MISS


def test_a_dump_under_an_ascii_locale_compiles(tmp_path):
    """Under LC_ALL=C (no UTF-8 mode) the picture's arrows and a near-miss's √ failed the user's
    compile with a UnicodeError (a review's): the dump writes and reads utf-8, and no failure of
    its own reaches the compile."""
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0",
               PYTHONIOENCODING="ascii")
    tests = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, "-c", _ASCII_CHILD, str(tmp_path), str(tests / "lowering"), str(tests)],
                          env=env, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
    reports = list(tmp_path.glob("run-*/graph_*/report.txt"))
    assert len(reports) == 2 and any("√" in r.read_text(encoding="utf-8") for r in reports)


def test_taken_run_folder_name_gets_a_suffix(tmp_path, monkeypatch):
    monkeypatch.setattr(dump, "_run_folders", {})
    monkeypatch.setattr(dump.time, "strftime", lambda fmt: "20260101-000000")
    taken = tmp_path / f"run-20260101-000000-{os.getpid()}"
    taken.mkdir()
    assert dump.run_folder(str(tmp_path)) == taken.with_name(taken.name + "-1")
    assert dump.run_folder(str(tmp_path)) == taken.with_name(taken.name + "-1")  # one per process


_CHILD = """
import sys, torch
import mha_compile.models as models
torch.manual_seed(int(sys.argv[1]))
torch.compile(models.MHABlock(32, 2, 64, 4, 2), backend="mha")(torch.randn(4, 3, 32), torch.randn(4, 5, 32))
"""


def test_two_processes_dumping_to_one_folder_do_not_clobber(tmp_path):
    env = dict(os.environ, MHA_COMPILE_DUMP=str(tmp_path), TORCH_LOGS="+mha_compile",
               TORCH_TRACE=str(tmp_path / "trace"))
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(seed)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    results = [(p.pid, *p.communicate(timeout=300), p.returncode) for p in procs]
    for pid, stdout, stderr, rc in results:
        assert rc == 0, stderr[-3000:]
        (run,) = [r for r in tmp_path.glob("run-*") if r.name.split("-")[3] == str(pid)]
        assert (run / "index.html").is_file() and len(_doc(run / "graph_000")["matches"]) == 1
        assert "mha_compile: graph 0 report:" in stderr  # TORCH_LOGS="+mha_compile" shows our DEBUG logs
    assert len(list(tmp_path.glob("run-*"))) == 2
    assert all([g.name for g in run.glob("graph_*")] == ["graph_000"] for run in tmp_path.glob("run-*"))
    traces = "".join(p.read_text() for p in (tmp_path / "trace").glob("*"))
    assert traces.count('"name": "mha_compile_report"') == 2 and "mha_compile_report_text" in traces
