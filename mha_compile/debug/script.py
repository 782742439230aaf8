"""A GraphModule as a runnable Python script: the graph's code, random inputs, a `main`.

The script holds `class Graph(torch.nn.Module)` whose `forward` is the FX graph's own code,
`make_inputs(seed=0, device=None)` that builds inputs of the recorded shapes, dtypes and
strides (a symbolic size becomes its hint; floats are standard normal, integers and bools are
0 or 1 drawn from a seeded generator), and a `__main__` that runs the graph and prints each
output's shape and dtype. `--save FILE` writes {"inputs": [...], "outputs": ...} with
torch.save, so a run can be compared with anything else fed the same inputs.

Tensors the graph reads with get_attr (constants, buffers not lifted to inputs) are saved
beside the script (`<stem>_constants.pt`) and loaded from there; nested GraphModules (the
bodies of higher-order ops) become nested classes.
"""
import importlib
import textwrap
import types

import torch

# Graphs that call our op need it registered before they run.
_OP_IMPORT = ("import mha_compile.ops  # registers torch.ops.mha.region\n"
              "import mha_compile.pool_moe_ops  # registers torch.ops.mha.pool and mha.moe (a pool split's graphs)\n")


def concrete(size):
    """An int for a (possibly symbolic) size: the size itself, or its hint."""
    if isinstance(size, int):
        return size
    try:
        from torch.fx.experimental.symbolic_shapes import hint_int
        return int(hint_int(size))
    except Exception:  # an unbacked size without a hint: any small positive size will do
        hint = getattr(getattr(size, "node", None), "hint", None)
        return int(hint) if hint is not None else 2


def input_specs(gm):
    """[(name, spec)] for gm's placeholders: spec is a dict describing what to build."""
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            specs.append((node.name, {"kind": "tensor", "shape": [concrete(d) for d in value.shape],
                                      "stride": [concrete(s) for s in value.stride()],
                                      "dtype": str(value.dtype).replace("torch.", ""),
                                      "device": str(value.device),
                                      "symbolic": [str(d) for d in value.shape]}))
        elif isinstance(value, (int, torch.SymInt, bool)):
            specs.append((node.name, {"kind": "int", "value": concrete(value), "symbolic": str(value)}))
        elif isinstance(value, (float, torch.SymFloat)):
            hint = value.node.hint if isinstance(value, torch.SymFloat) else value
            specs.append((node.name, {"kind": "float", "value": float(hint if hint is not None else 1.0)}))
        else:
            specs.append((node.name, {"kind": "none", "type": type(value).__name__}))
    return specs


def graph_script(gm, title, filename="graph.py", constants_file=None, needs_ops=False):
    """(script text, {constant name: tensor}) rebuilding gm; constants go to constants_file."""
    constants = {}
    classes = []
    _emit_class(gm, "Graph", classes, constants, prefix="")
    header = (f'"""{title}\n\nRun: python {filename} [--seed N] [--device cpu] [--save out.pt]\n'
              "Inputs (parameters included) are random, of the recorded shapes: see make_inputs.\n"
              '"""\n'
              "import argparse\nimport os\n\nimport torch\n")
    if needs_ops:
        header += _OP_IMPORT
    imports = _imports(gm)
    body = "\n\n".join(classes)
    specs = input_specs(gm)
    lines = [header, imports, "", f"CONSTANTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "
             f"{constants_file!r})" if constants else "CONSTANTS = None", "",
             _CONSTANT_HELPERS, "", body, "", _make_inputs(specs), _MAIN]
    return "\n".join(lines), constants


def _emit_class(gm, class_name, classes, constants, prefix):
    """Append `class class_name` for gm (nested GraphModules first) to classes."""
    init = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _get_attr(gm, node.target)
        if isinstance(value, torch.fx.GraphModule):
            sub = f"{class_name}_{node.target.replace('.', '_')}"
            _emit_class(value, sub, classes, constants, prefix + node.target + ".")
            # traced back into a GraphModule: the higher-order op that calls it reads its graph and meta
            # (tag_activation_checkpoint; as a plain module the scripts of a checkpointed block raised)
            init.append(f"_set(self, {node.target!r}, torch.fx.symbolic_trace({sub}()))")
        elif isinstance(value, torch.Tensor):
            key = prefix + node.target
            constants[key] = value.detach().cpu().clone()
            init.append(f"_set(self, {node.target!r}, _constant({key!r}, {list(value.shape)!r}, "
                        f"torch.{str(value.dtype).replace('torch.', '')}, "
                        f"{isinstance(value, torch.nn.Parameter)!r}))")
        elif isinstance(value, torch.nn.Module):
            init.append(f"_set(self, {node.target!r}, {value!r})  # an nn.Module the graph calls")
        else:
            init.append(f"_set(self, {node.target!r}, {value!r})")
    for node in gm.graph.nodes:
        if node.op == "call_module":
            init.append(f"_set(self, {node.target!r}, {_get_attr(gm, node.target)!r})")
    code = gm.graph.python_code(root_module="self").src
    init_src = "\n".join(["def __init__(self):", "    super().__init__()"] + ["    " + line for line in init]) + "\n"
    classes.append(f"class {class_name}(torch.nn.Module):\n" + textwrap.indent(init_src, "    ") + "\n"
                   + textwrap.indent(code.strip("\n"), "    ") + "\n")


def _get_attr(module, target):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _imports(gm):
    """Import lines for the names gm's code uses (torch, device, inf, pytree helpers...)."""
    names = {}
    _collect_globals(gm, names)
    lines = []
    for name, value in sorted(names.items()):
        if name == "torch":
            continue
        if isinstance(value, types.ModuleType):
            lines.append(f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}")
        elif isinstance(value, float):
            lines.append(f"{name} = float({str(value)!r})")
        elif value is type(None):
            lines.append(f"{name} = type(None)")
        elif _importable(value):
            lines.append(f"from {value.__module__} import {value.__qualname__} as {name}"
                         if "." not in value.__qualname__ else
                         f"import {value.__module__}\n{name} = {value.__module__}.{value.__qualname__}")
        else:
            lines.append(f"{name} = None  # not importable: {value!r}; calls to it will fail")
    return "\n".join(lines)


def _collect_globals(gm, names):
    names.update(gm.graph.python_code(root_module="self").globals)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _get_attr(gm, node.target)
            if isinstance(value, torch.fx.GraphModule):
                _collect_globals(value, names)


def _importable(value):
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return False
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is value


def _make_inputs(specs):
    lines = ["def make_inputs(seed=0, device=None):",
             '    """Inputs of the recorded shapes, dtypes and strides (symbolic sizes: their hint)."""',
             "    gen = torch.Generator().manual_seed(seed)",
             "    inputs = []"]
    for name, spec in specs:
        if spec["kind"] == "tensor":
            comment = f"  # {name}: [{', '.join(spec['symbolic'])}]"
            lines.append(f"    inputs.append(_tensor({spec['shape']!r}, {spec['stride']!r}, "
                         f"torch.{spec['dtype']}, {spec['device']!r}, device, gen)){comment}")
        elif spec["kind"] == "int":
            note = f" = {spec['symbolic']}" if spec["symbolic"] != name else " (a symbolic size: its hint)"
            lines.append(f"    inputs.append({spec['value']!r})  # {name}{note}")
        elif spec["kind"] == "float":
            lines.append(f"    inputs.append({spec['value']!r})  # {name}")
        else:
            lines.append(f"    inputs.append(None)  # {name}: a {spec['type']} the dump cannot rebuild")
    lines.append("    return inputs")
    return "\n".join(lines) + "\n"


_CONSTANT_HELPERS = '''\
def _set(module, target, value):
    *path, last = target.split(".")
    for part in path:
        if not hasattr(module, part):
            setattr(module, part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        module.register_buffer(last, value)
    else:
        setattr(module, last, value)


_SAVED = None


def _constant(key, shape, dtype, parameter):
    """A tensor the graph reads with get_attr: saved beside this file, else random."""
    global _SAVED
    if _SAVED is None:
        _SAVED = torch.load(CONSTANTS) if CONSTANTS and os.path.exists(CONSTANTS) else {}
    value = _SAVED.get(key)
    if value is None:
        value = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(value, requires_grad=False) if parameter else value


def _tensor(shape, stride, dtype, recorded_device, device, gen):
    device = device or (recorded_device if recorded_device == "cpu" or torch.cuda.is_available() else "cpu")
    value = torch.empty_strided(shape, stride, dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        value.normal_(generator=gen)
    else:
        value.random_(0, 2, generator=gen)
    return value.to(device)
'''

_MAIN = '''
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of make_inputs")
    parser.add_argument("--device", default=None, help="run on this device instead of the recorded one")
    parser.add_argument("--save", default=None, help="torch.save {'inputs', 'outputs'} to this file")
    args = parser.parse_args()
    graph = Graph().to(args.device) if args.device else Graph()
    inputs = make_inputs(args.seed, args.device)
    with torch.no_grad():
        outputs = graph(*inputs)
    flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    for i, out in enumerate(flat):
        if isinstance(out, torch.Tensor):
            print(f"output {i}: shape {list(out.shape)} dtype {out.dtype}")
        else:
            print(f"output {i}: {out!r}")
    if args.save:
        torch.save({"inputs": inputs, "outputs": outputs}, args.save)


if __name__ == "__main__":
    main()
'''
