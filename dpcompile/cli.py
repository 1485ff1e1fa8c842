"""The ``dpcompile`` command: ``demo``, ``inspect`` and ``export``.

    dpcompile demo
    dpcompile inspect model.py:make_model --devices 2 [--tensor-parallel] [--draw out.svg] [--json]
    dpcompile export model.py:make_model --devices 4 -o exported/

``FACTORY`` is a callable in ``FILE.py`` returning the model, or ``(model, example_inputs)``.
Errors are one line on stderr and a non-zero exit; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpcompile.errors import first_line

EXIT_ERROR = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


# ------------------------------------------------------------------------------ helpers
def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _parse_devices(text: str) -> Any:
    """``"4"`` → 4 (the first 4 GPUs, or 4 virtual CPU devices); ``"cpu,cpu"`` → a list."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"--devices {text!r}: give a count (4) or a list (cuda:0,cuda:1)")
    return [int(p) if p.isdigit() else p for p in parts]


def load_factory(spec: str) -> tuple[Any, tuple | None]:
    """Run ``FILE.py:FACTORY``; return ``(model, example_inputs or None)``."""
    from torch import nn

    if ":" not in spec:
        raise CliError(f"{spec!r} is not FILE.py:FACTORY (e.g. model.py:make_model)")
    file_text, factory_name = spec.rsplit(":", 1)
    path = Path(file_text)
    if not path.is_file():
        raise CliError(f"no such file: {file_text}")
    if not factory_name.isidentifier():
        raise CliError(f"{factory_name!r} is not a Python name; expected FILE.py:FACTORY")
    module_name = f"dpcompile_user_{path.stem}"
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec_obj = importlib.util.spec_from_file_location(module_name, path)
        if spec_obj is None or spec_obj.loader is None:
            raise CliError(f"cannot import {file_text} (is it a .py file?)")
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[module_name] = module
        try:
            spec_obj.loader.exec_module(module)
        except Exception as e:
            raise CliError(f"importing {file_text} failed: {type(e).__name__}: {first_line(e)}") from e
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CliError(f"{file_text} has no callable {factory_name!r} (it defines: {', '.join(names) or 'nothing callable'})")
    try:
        made = factory()
    except Exception as e:
        raise CliError(f"{factory_name}() failed: {type(e).__name__}: {first_line(e)}") from e
    example: tuple | None = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, example = made
        if not isinstance(example, (tuple, list)):
            example = (example,)
        example = tuple(example)
    if not isinstance(made, nn.Module):
        raise CliError(
            f"{factory_name}() returned {type(made).__name__}; expected an nn.Module or (module, example_inputs)"
        )
    return made, example


def _transform(model: Any, devices: Any, tensor_parallel: bool, example: tuple | None) -> Any:
    import dpcompile

    try:
        return dpcompile.transform(model, devices, tensor_parallel=tensor_parallel, example_inputs=example)
    except ImportError as e:
        raise CliError(f"--tensor-parallel is not available in this installation ({first_line(e)})") from e


# ----------------------------------------------------------------------------- commands
def cmd_demo(args: argparse.Namespace) -> int:
    """Transform the built-in model for this machine's devices; show code, explain and verify."""
    import torch

    import dpcompile
    from dpcompile.demo import build, demo_devices

    model, example = build()
    devices = demo_devices()
    reference = build()[0]
    reference.load_state_dict(model.state_dict())
    pm = dpcompile.transform(model, devices, example_inputs=example)
    _out(f"# dpcompile demo: an LSTM block and an MLP on {devices}")
    _out("\n# The generated program (pm.code)")
    _out(pm.code.strip("\n"))
    _out("\n# dpcompile.explain(pm, x)")
    _out(str(dpcompile.explain(pm, *example)))
    result = dpcompile.verify(pm, model, *example)
    _out("\n# dpcompile.verify(pm, model, x)")
    _out(str(result))
    with torch.no_grad():
        same = torch.allclose(pm(*example), reference.to(devices[0])(*[x.to(devices[0]) for x in example]), atol=1e-5)
    _out(f"  outputs equal the untouched single-device model: {same}")
    return 0 if result and same else EXIT_ERROR


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the generated code and the explain table (or JSON) for FILE.py:FACTORY."""
    import dpcompile

    model, example = load_factory(args.target)
    pm = _transform(model, args.devices, args.tensor_parallel, example)
    report = dpcompile.explain(pm, *(example or ()))
    drawn = dpcompile.draw(pm, args.draw) if args.draw else None
    if args.json:
        payload = {"code": pm.code, "report": report.to_dict(), "picture": str(drawn) if drawn else None}
        _out(json.dumps(payload, indent=2))
        return 0
    _out(f"# {args.target} on {pm.devices.strings() if hasattr(pm.devices, 'strings') else pm.devices}")
    _out(pm.code.strip("\n"))
    _out()
    _out(str(report))
    if example is None:
        _out("\n(no example inputs: return (model, example_inputs) from the factory for shapes and communication)")
    if drawn:
        _out(f"\npicture written to {drawn}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Transform FILE.py:FACTORY and write an export folder."""
    import dpcompile

    model, example = load_factory(args.target)
    pm = _transform(model, args.devices, args.tensor_parallel, example)
    folder = dpcompile.export(pm, args.output)
    _out(f"exported {type(model).__name__} ({pm.mode} on {pm.devices.strings()}) to {folder}")
    for item in sorted(folder.iterdir()):
        _out(f"  {item.name}")
    _out("load it with dpcompile.load(folder): it checks every file and runs no code from the folder (docs/export.md)")
    return 0


# ------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command each for demo, inspect and export)."""
    parser = argparse.ArgumentParser(
        prog="dpcompile",
        description="Compile a single-device PyTorch model into a readable multi-device program.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # the commands take --debug too; SUPPRESS keeps their default from undoing `dpcompile --debug CMD`
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", parents=[debug], help="run the built-in demo (seconds, no GPU needed)",
                               description=cmd_demo.__doc__)
    demo.set_defaults(run=cmd_demo)
    for name, fn, text in (
        ("inspect", cmd_inspect, "show the generated code and the explain table"),
        ("export", cmd_export, "write an export folder (module.py, weights, manifest)"),
    ):
        sub = commands.add_parser(name, parents=[debug], help=text, description=fn.__doc__)
        sub.add_argument("target", metavar="FILE.py:FACTORY",
                         help="a callable returning the model, or (model, example_inputs)")
        sub.add_argument("--devices", type=_parse_devices, required=True, metavar="N",
                         help="a device count (virtual CPU devices without CUDA) or a list: cuda:0,cuda:1")
        sub.add_argument("--tensor-parallel", action="store_true", help="shard nn.Linear layers (automatic plan)")
        if name == "inspect":
            sub.add_argument("--draw", metavar="OUT.svg", help="also write a picture (SVG via graphviz, else PNG)")
            sub.add_argument("--json", action="store_true", help="print JSON (code and report) instead of tables")
        else:
            sub.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")
        sub.set_defaults(run=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dpcompile`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="dpcompile: %(levelname)s: %(message)s")
    try:
        return int(args.run(args))
    except Exception as e:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        from dpcompile.errors import DpCompileError

        if isinstance(e, (CliError, DpCompileError, ValueError)):
            message = first_line(e)
        else:
            message = f"{type(e).__name__}: {first_line(e)} (run with --debug for the traceback)"
        sys.stderr.write(f"dpcompile: error: {message}\n")
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
