"""Command line: `python -m mha_compile explain path/to/script.py:factory [--dump folder]`.

`factory` is a function in the script, called with no arguments, that returns
`(model, example_inputs)`: a module or function and a tuple (or list) of its positional
inputs. The model is compiled with backend="mha" and run once, forward only, with grad
enabled (as training compiles it; mha_compile.explain runs in its caller's grad mode); the
explain report (what matched, which kernels, what nearly matched and why) is printed, as text
or with --json as JSON. --dump writes the same graph dump folder as MHA_COMPILE_DUMP. --option
KEY=VALUE sets any other backend option (README's Options; true/false and none as Python's True,
False and None), and --dynamic compiles as torch.compile(..., dynamic=True) does.
"""
import argparse
import importlib.util
import contextlib
import json
import sys
from pathlib import Path

from mha_compile.options import KERNELS, REST, Options


class UsageError(Exception):
    """A bad command line or factory: printed as one line, exit status 2."""


def load_factory(spec):
    """The function named by "path/to/script.py:function"."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"expected path/to/script.py:function, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file" if not file.exists() else f"{path}: not a file")
    module_spec = importlib.util.spec_from_file_location(f"_mha_explain_{file.stem}", file)
    if module_spec is None:
        raise UsageError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.resolve().parent))  # so the script can import its neighbours
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        what = "no function" if factory is None else "a non-callable"
        raise UsageError(f"{path} has {what} {name!r}; functions defined there: {', '.join(defined) or 'none'}")
    return factory


def call_factory(factory, spec):
    """(model, inputs) from the factory, checked."""
    made = factory()
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise UsageError(f"{spec} must return (model, example_inputs); it returned {_kind(made)}")
    model, inputs = made
    if not callable(model):
        raise UsageError(f"{spec} returned a model that is not callable: {_kind(model)}")
    if not isinstance(inputs, (tuple, list)):
        raise UsageError(f"{spec} must return example_inputs as a tuple of the model's positional inputs; "
                         f"it returned {_kind(inputs)} (write (x,) for a single input)")
    return model, tuple(inputs)


def _kind(value):
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def backend_options(args):
    """The backend's options from --kernels, --rest, --dump and each --option KEY=VALUE, checked
    as torch.compile would check them (a bad key or value is a usage error naming what is allowed)."""
    options = {"kernels": args.kernels, "rest": args.rest}
    for item in args.option:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--option {item!r}: expected KEY=VALUE, e.g. --option keep_hidden=true")
        options[key] = {"true": True, "false": False, "none": None}.get(text.lower(), text)
    if args.dump:
        options["dump"] = args.dump
    try:
        Options.parse(options)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    return options


def explain_command(args):
    from mha_compile.debug import dump
    from mha_compile.debug.explain import explain

    # with --json, what the factory and the model print goes to stderr: stdout is the report alone,
    # for a JSON reader (a review's: a model's print made it unreadable)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        options = backend_options(args)
        model, inputs = call_factory(load_factory(args.spec), args.spec)
        report = explain(model, *inputs, mha_options=options, mha_dynamic=True if args.dynamic else None)
    print(json.dumps(report.to_json(), indent=2, default=str) if args.json else report)
    if args.dump:
        run = dump.current_run(args.dump)
        if run is not None and (run / "index.html").exists():
            print(f"dump: {run / 'index.html'}", file=sys.stderr)
        else:
            print(f"dump: nothing written under {args.dump} (see the warning above)", file=sys.stderr)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mha_compile", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="what backend='mha' does to a model: matches, kernels, near-misses")
    explain.add_argument("spec", help="path/to/script.py:factory, factory() -> (model, example_inputs_tuple)")
    explain.add_argument("--dump", metavar="FOLDER",
                         help="also write a graph dump (scripts, reports, pictures, index.html)")
    explain.add_argument("--kernels", choices=KERNELS, default="auto")
    explain.add_argument("--rest", choices=REST, default="eager")
    explain.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                         help="another backend option (repeatable), e.g. --option keep_hidden=true")
    explain.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic sizes)")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        return explain_command(args)
    except UsageError as error:
        print(f"python -m mha_compile {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
