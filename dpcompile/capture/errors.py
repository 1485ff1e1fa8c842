"""``TraceError``: what could not be captured, where in the user's code, and the way out.

``model.py:42 in Encoder.forward: 'if y.sum() > 0' branches on a tensor value; ...``

The way out is always concrete: a module class *below* the model to mark as a leaf (one
that appears in the failing call stack), or ``example_inputs=`` for the export frontend,
which captures shape and dtype branches that ``torch.fx`` cannot.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import traceback
from types import TracebackType

import torch
import torch.fx as fx
from torch import nn

from dpcompile.errors import ArgumentError, ExampleError, TraceError, first_line

# a trailing separator, so that torch's directory does not swallow ``torchvision/``
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PASSES_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR.rstrip(os.sep)), "passes") + os.sep
#: one frame of a formatted stack (fx's and export's ``stack_trace``, :func:`user_source_line`)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')

EXPORT_WAY_OUT = "pass example_inputs= (the export frontend, frontend='export' or 'auto') to capture it with torch.export"


class ShapeBranch(Exception):
    """Raised by the tracer where Python branches on a shape, a dtype or a Python argument."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def _is_library_file(filename: str) -> bool:
    """Torch's and dpcompile's own files (its passes too), and generated code: never the user's line."""
    if filename.startswith(_PACKAGE_DIR) and filename.endswith(os.sep + "demo.py"):
        return False  # the built-in demo model is user code
    return filename.startswith((_TORCH_DIR, _PACKAGE_DIR, _PASSES_DIR, "<"))


is_library_file = _is_library_file

_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")


def is_installed_package_file(filename: str) -> bool:
    """A file of an installed package (transformers' reads of the grad mode or a module's mode are its own
    business, as torch's are), not the user's code."""
    return bool(_INSTALLED.search(filename))


def trace_source(trace: str | None) -> str | None:
    """``"model.py:42 in forward: h = self.fc1(x)"``: the user's innermost frame in a formatted stack
    (a node's ``stack_trace``, :func:`user_source_line`); None where every frame is torch's or ours."""
    for m in reversed(list(_FRAME.finditer(trace or ""))):
        filename = m.group("file")
        if not _is_library_file(filename):
            return f"{filename.rsplit('/', 1)[-1]}:{m.group('line')} in {m.group('func')}: {m.group('code').strip()}"
    return None


def user_source(node: fx.Node) -> str | None:
    """``"model.py:42 in forward: h = self.fc1(x)"``: the user's frame in the node's ``stack_trace``."""
    return trace_source(node.meta.get("stack_trace"))


def user_source_line() -> str | None:
    """The innermost user frame, formatted as a one-frame traceback (cheaper than fx's
    ``record_stack_traces``, which formats the whole stack for every node)."""
    frame = sys._getframe(2)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {line}\n'


def user_frame(tb: TracebackType | None) -> tuple[traceback.FrameSummary, TracebackType] | None:
    """The innermost frame of the traceback that is not torch's or ours (any package counts:
    timm, transformers and torchvision code is the user's as far as the message goes)."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    for entry in reversed(entries):
        code = entry.tb_frame.f_code
        if _is_library_file(code.co_filename):
            continue
        summary = traceback.FrameSummary(code.co_filename, entry.tb_lineno, code.co_name)
        return summary, entry
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ShapeBranch):
        return exc.kind
    text = first_line(exc)
    if "symbolically traced variables cannot be used as inputs to control flow" in text:
        return "branches on a tensor value (control flow that depends on data)"
    if "iterate" in text and "Proxy" in text:
        return "iterates over a traced value (for `*inputs`: index it, inputs[0], or name the arguments)"
    return f"{type(exc).__name__}: {text}"


def _modules_on_stack(tb: TracebackType | None) -> list[nn.Module]:
    """The modules whose code is on the failing stack (their ``self``), outermost first."""
    out: list[nn.Module] = []
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not out or out[-1] is not owner):
            out.append(owner)
        tb = tb.tb_next
    return out


def runs_a_packed_sequence(tb: TracebackType | None) -> bool:
    """Whether the failing stack holds a ``PackedSequence`` (``pack_padded_sequence``'s), which
    torch.export cannot run an RNN on: its ``batch_sizes`` are sizes read from data."""
    from torch.nn.utils.rnn import PackedSequence

    while tb is not None:
        if any(isinstance(v, PackedSequence) for v in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def leaf_to_suggest(tb: TracebackType | None, model: nn.Module) -> type[nn.Module] | None:
    """The class of the innermost module below ``model`` whose code failed: making it a leaf
    gets the tracer past the failure. None where the failing code is the model's own."""
    below = {id(m) for m in model.modules() if m is not model}
    for module in reversed(_modules_on_stack(tb)):
        if id(module) in below and type(module) is not type(model) and not type(module).__module__.startswith("torch.fx"):
            return type(module)
    return None


def _self_in_varargs_decorator(model: nn.Module) -> str | None:
    """The name of the decorator that wraps ``forward`` as ``wrapper(*args, **kwargs)``, ``self``
    among ``args`` (transformers' ``deprecate_kwarg``): fx cannot give such a root function its
    arguments (``ValueError: code: co_varnames is too small``). None for any other forward."""
    forward = type(model).forward
    code = getattr(forward, "__code__", None)
    if code is None or not hasattr(forward, "__wrapped__"):
        return None
    if code.co_argcount or not code.co_flags & inspect.CO_VARARGS:
        return None
    return code.co_qualname.split(".<locals>", 1)[0]


def _arguments_hidden_by_a_wrapper(model: nn.Module) -> str | None:
    """The name of the function that stands for ``forward`` as ``wrapper(self, *args, **kwargs)``
    without ``functools.wraps`` (so neither frontend sees forward's own arguments); None otherwise."""
    forward = type(model).forward
    code = getattr(forward, "__code__", None)
    if code is None or hasattr(forward, "__wrapped__") or code.co_name == "forward":
        return None
    return code.co_name if code.co_argcount <= 1 and code.co_flags & inspect.CO_VARARGS else None


def trace_error(exc: BaseException, model: nn.Module) -> TraceError:
    """Build the :class:`TraceError` for an exception raised while tracing ``model``."""
    decorator = _self_in_varargs_decorator(model) if "co_varnames is too small" in first_line(exc) else None
    if decorator is not None:
        return TraceError(
            f"cannot trace {type(model).__name__} with torch.fx: its forward is wrapped by '{decorator}' as "
            "wrapper(*args, **kwargs), self among args, which fx cannot trace (as transformers 5.x wraps "
            f"forwards; {_describe(exc)}); {EXPORT_WAY_OUT}"
        )
    found = user_frame(exc.__traceback__)
    leaf = leaf_to_suggest(exc.__traceback__, model)
    ways = []
    if (wrapper := _arguments_hidden_by_a_wrapper(model)) and "iterate" in first_line(exc):
        ways.append(
            f"{type(model).__name__}.forward is '{wrapper}(self, *args, **kwargs)', a wrapper that hides forward's "
            f"arguments: decorate '{wrapper}' with @functools.wraps(forward) so both frontends see them"
        )
    if leaf is not None:
        ways.append(
            f"mark the module as a leaf (leaf_modules=[{leaf.__name__}]) so the tracer does not enter it "
            "(it then runs whole, after a gather)"
        )
    ways.append(EXPORT_WAY_OUT)
    if not isinstance(exc, ShapeBranch):
        ways.append("or make the code traceable (torch.where for a branch on data)")
    way_out = "; ".join(ways)
    if found is None:
        return TraceError(f"cannot trace {type(model).__name__}: {_describe(exc)}; {way_out}")
    frame, entry = found
    source = linecache.getline(frame.filename, frame.lineno).strip()
    short = frame.filename.rsplit("/", 1)[-1]
    owner = entry.tb_frame.f_locals.get("self")
    where = f"{type(owner).__name__}.{frame.name}" if isinstance(owner, nn.Module) else frame.name
    return TraceError(f"{short}:{frame.lineno} in {where}: {source!r} {_describe(exc)}; {way_out}\n  file: {frame.filename}")


def check_signature(model: nn.Module) -> None:
    """Refuse, before any tracing, a ``forward`` no frontend can give a program's arguments:
    a default value generated code cannot spell (a tensor, an instance of the user's class, a function), each with the way out."""
    import inspect

    forward = inspect.unwrap(type(model).forward)
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return
    where = f"{type(model).__name__}.forward"
    for p in parameters:
        if p.default is p.empty:
            continue
        if any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(p.default)):
            raise TraceError(
                f"{where}: argument '{p.name}' has a tensor as its default value, which generated code cannot "
                f"spell; default it to None and make the tensor in forward (`if {p.name} is None: {p.name} = ...`), "
                "or register it as a buffer"
            )
        if not _spellable(p.default):
            raise TraceError(
                f"{where}: argument '{p.name}' defaults to {_short_repr(p.default)} (a {type(p.default).__name__}), "
                "which generated code cannot spell as a default value; default it to None and make the value in "
                f"forward (`if {p.name} is None: {p.name} = ...`)"
            )


_PLAIN_DEFAULTS = (type(None), bool, int, str)


def _spellable(value: object) -> bool:
    """Whether ``torch.fx`` code generation writes ``value`` as a default that evaluates (a
    literal, a dtype, an enum), not ``cfg = cfg`` or ``act = <function relu at 0x...>``."""
    if isinstance(value, _PLAIN_DEFAULTS):
        return True
    graph = fx.Graph()
    graph.output(graph.placeholder("a", default_value=value))
    try:
        fx.GraphModule(nn.Module(), graph)
    except Exception:  # noqa: BLE001 - a NameError, a SyntaxError: code that does not compile or run
        return False
    return True


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_examples(model: nn.Module, example_inputs: tuple | None, example_kwargs: object) -> None:
    """Refuse, before any tracing, examples ``forward`` cannot take (too many, too few, a keyword
    it does not have), in Python's words, with ``forward``'s signature to compare against.

    >>> check_examples(nn.Linear(4, 2), (torch.ones(3, 4), torch.ones(3, 4)), None)
    Traceback (most recent call last):
    dpcompile.errors.ExampleError: example_inputs= do not fit Linear.forward(input: torch.Tensor) -> torch.Tensor: too many positional arguments; ...
    """
    import inspect
    from collections.abc import Mapping

    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise ExampleError(
            f"example_kwargs= must be a dict {{argument name: example}}, got {type(example_kwargs).__name__}; "
            "pass positional examples as example_inputs=(...)"
        )
    if example_inputs is None and not example_kwargs:
        return
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = signature.parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = [k for k in example_kwargs or {} if k not in signature.parameters]
        if unknown:
            raise ExampleError(
                f"example_kwargs= name {unknown[0]!r}, which {type(model).__name__}.forward{signature} does not take; "
                f"its arguments are {[p.name for p in params]}"
            )
    try:
        signature.bind(*(example_inputs or ()), **dict(example_kwargs or {}))
    except TypeError as e:
        given = "example_inputs=" if not example_kwargs else "example_inputs=/example_kwargs=" if example_inputs else "example_kwargs="
        raise ExampleError(
            f"{given} do not fit {type(model).__name__}.forward{signature}: {e}; give one example per argument "
            "forward takes, positional ones in example_inputs=(...) and keyword ones in example_kwargs={...}"
        ) from None


def check_forward_names(model: nn.Module, dynamic_dims: dict) -> None:
    """Without examples, ``dynamic_dims=`` names are checked against forward's own arguments."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward Python cannot describe: nothing to check against
        return
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters.values()):
        return
    if unknown := sorted(set(dynamic_dims) - set(parameters)):
        raise ArgumentError(
            f"dynamic_dims= names {unknown}, which {type(model).__name__}.forward does not take (it takes "
            f"{list(parameters)}); name its arguments"
        )
