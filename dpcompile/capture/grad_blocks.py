"""``torch.no_grad()`` blocks of an exported graph, inlined as the fx frontend writes them.

torch.export keeps a block that turns grad off (a forward under ``@torch.no_grad()``, as SpeechT5's
and Marian's sinusoidal position embeddings) as one higher-order op calling a subgraph. No pass sees
into it: data parallelism ran it, and everything after it, whole on the gathered batch. Its ops go
back into the program, each output leaving through :func:`~dpcompile.runtime.without_grad`
(detached: no gradient flows back through the block, as in eager)::

    submod_1 = self.submod_1                              pos = aten.cumsum(aten.ones_like(x), -1)
    wrap = higher_order.wrap_with_set_grad_enabled(  ->   sin = aten.sin(pos)
        False, submod_1, x)                               sin_no_grad = without_grad(sin)
    sin = wrap[0]                                         add = aten.add(x, sin_no_grad)
    add = aten.add(x, sin)

The block's inputs enter it detached too, buffers apart (ops inside the block neither record
autograd nor save what they read, so the block's in-place writes, as spectral_norm's power
iteration ``div(mv(W, v), norm, out=self._u)``, run as in eager)::

    wrap = higher_order.wrap_with_set_grad_enabled(  ->   w_no_grad = without_grad(w)
        False, submod_1, w, u)                            mv = aten.mv(w_no_grad, v)

A block that turns grad on (``torch.enable_grad()`` inside a no-grad forward) is left as it is.
"""

from __future__ import annotations

import contextlib
import operator
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import attribute_at
from dpcompile.runtime.grad import without_grad

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


@contextlib.contextmanager
def inference_mode_as_no_grad() -> Iterator[None]:
    """While a frontend captures forward, ``torch.inference_mode()`` inside it turns grad off as
    ``torch.no_grad()`` does, which both frontends record. Neither records inference mode itself (fx
    runs the switch, torch.export drops it), so the block's values would carry gradients in the
    program and train the parameters they read, where eager leaves those without a gradient::

        with torch.inference_mode():              with torch.inference_mode():   # captured as
            h = self.a(x)              ->             h = self.a(x)              # torch.no_grad()
        return self.b(h.clone())                  return self.b(without_grad(h).clone())
    """
    enter, leave = torch.inference_mode.__enter__, torch.inference_mode.__exit__

    def entered(context: torch.inference_mode) -> None:
        context._grad_before = torch.is_grad_enabled()  # type: ignore[attr-defined]
        if context.mode:
            torch._C._set_grad_enabled(False)  # looked up here: the fx tracer records its switches there

    def left(context: torch.inference_mode, *exc: Any) -> None:
        torch._C._set_grad_enabled(context._grad_before)  # type: ignore[attr-defined]

    torch.inference_mode.__enter__, torch.inference_mode.__exit__ = entered, left  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.inference_mode.__enter__, torch.inference_mode.__exit__ = enter, leave  # type: ignore[method-assign]




@contextlib.contextmanager
def grad_mode_reads(pretend: bool | None = None) -> Iterator[list[str]]:
    """While a frontend captures forward: where the user's code reads ``torch.is_grad_enabled()`` (torch's own
    reads, nn.MultiheadAttention's fast path, are the ops' business, and an installed library's). Capture takes the branch of the grad
    mode it runs in, so the program checks that mode at each call (:func:`check_grad_mode`). ``pretend``: the
    user's reads get that value instead (a second capture, to tell a branch from a read that decides nothing)."""
    from dpcompile.capture.errors import is_installed_package_file, is_library_file, trace_source, user_source_line

    reads: list[str] = []
    original = torch.is_grad_enabled

    def recorded() -> bool:
        caller = sys._getframe(1).f_code.co_filename
        # an installed library's read guards speed, not values (transformers: checkpointing only with gradients)
        if not is_library_file(caller) and not is_installed_package_file(caller):
            reads.append(trace_source(user_source_line()) or "forward")
            if pretend is not None:
                return pretend
        return original()

    torch.is_grad_enabled = recorded  # type: ignore[assignment]
    try:
        yield reads
    finally:
        torch.is_grad_enabled = original  # type: ignore[assignment]


def export_decides_on_grad_mode(ep: Any, export_again: Callable[[], Any]) -> bool:
    """Whether forward's reads of ``torch.is_grad_enabled()`` change the exported program ``ep``: exported
    again with them returning False, a read that is only logged or stored exports the same code and
    constants (a branch between ``torch.tensor(1.0)`` and ``torch.tensor(2.0)`` differs only in them)."""
    try:
        with grad_mode_reads(pretend=False):
            other = export_again()
    except Exception:  # noqa: BLE001 - the other path does not export: it decides something
        return True
    constants, other_constants = dict(ep.constants), dict(other.constants)
    return other.graph_module.code != ep.graph_module.code or constants.keys() != other_constants.keys() or any(
        not (a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)))
        for a, b in ((constants[k], other_constants[k]) for k in constants)
    )


_STOWED = re.compile(r"\b_(?:tensor|param)_constant\d+\b")


def traced_alike(graph: fx.Graph, other: fx.Graph, root: Any) -> bool:
    """Whether two fx traces of ``root`` are one program: the same code, where the tensors fx stowed on
    ``root`` (``self._tensor_constant0``; the second trace's are numbered on) are read in the same order
    and hold the same values (a branch may add another constant)."""

    def spelled(g: fx.Graph) -> tuple[str, list[Any]]:
        order: dict[str, str] = {}
        src = _STOWED.sub(lambda m: order.setdefault(m.group(0), f"_stowed{len(order)}"), g.python_code("self").src)
        return src, [attribute_at(root, name) for name in order]

    (src, values), (other_src, other_values) = spelled(graph), spelled(other)
    return src == other_src and all(
        type(a) is type(b) and (a is b or not isinstance(a, torch.Tensor) or _same_tensor(a, b))
        for a, b in zip(values, other_values, strict=True)
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


@contextlib.contextmanager
def stowed_attributes_undone(root: Any) -> Iterator[None]:
    """What a trace inside stows on ``root`` (fx's ``_tensor_constantN``) is taken off it after."""
    before = set(getattr(root, "__dict__", ()))
    try:
        yield
    finally:
        for name in [n for n in getattr(root, "__dict__", ()) if n not in before and _STOWED.fullmatch(n)]:
            delattr(root, name)


def check_grad_mode(graph: fx.Graph, where: str, gradient_taken: bool = False) -> None:
    """Make the program check, at each call, that gradients are on, as they were where it was captured and
    forward read them (``where``): ``expect_grad_mode(True, where)`` after the inputs."""
    from dpcompile.runtime.exported import expect_grad_mode

    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(inputs[-1]) if inputs else graph.inserting_before(next(iter(graph.nodes))):
        graph.call_function(expect_grad_mode, (True, where, True) if gradient_taken else (True, where))


def check_gradients_taken_with_grad_on(graph: fx.Graph) -> None:
    """fx frontend: forward takes a gradient (``torch.autograd.grad``: a gradient penalty, an energy model's
    ``-grad(e, x)``), which needs gradients on; a ``with torch.enable_grad():`` around it ran while capture
    had them on already, so the program has no switch: a call under ``no_grad`` failed inside
    (``element 0 of tensors does not require grad``). The program checks at each call that gradients are
    on, naming the gradient's line."""
    from dpcompile.capture.errors import user_source

    taken = next((n for n in graph.nodes if n.op == "call_function" and n.target is torch.autograd.grad), None)
    if taken is not None:
        check_grad_mode(graph, user_source(taken) or taken.name, gradient_taken=True)


def find_no_grad_blocks(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``wrap_with_set_grad_enabled(False, body, ...)`` calls of ``gm``'s graph whose body is a submodule."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is _SET_GRAD and n.args and n.args[0] is False
        and isinstance(n.args[1], fx.Node) and n.args[1].op == "get_attr"
    ]  # fmt: skip


def inline_no_grad_blocks(gm: fx.GraphModule) -> bool:
    """Inline every no-grad block of ``gm`` (nested ones too), in place; whether one was."""
    changed = False
    while blocks := find_no_grad_blocks(gm):
        for block in blocks:
            _inline(gm, block)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def _inline(gm: fx.GraphModule, block: fx.Node) -> None:
    graph = gm.graph
    body_path = block.args[1].target
    body: fx.GraphModule = gm.get_submodule(body_path)
    operands = iter(block.args[2:])
    remap: dict[fx.Node, fx.Node] = {}
    outputs: tuple = ()
    with graph.inserting_before(block):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                remap[node] = _entering(gm, next(operands))
            elif node.op == "output":
                outputs = node.args[0]
            else:
                copied = graph.node_copy(node, lambda n: remap[n])
                if node.op == "get_attr":  # the body's own attribute, reached from the root
                    copied.target = f"{body_path}.{node.target}"
                remap[node] = copied
        results = []
        for value in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            if isinstance(value, fx.Node):
                detached = graph.call_function(without_grad, (remap[value],))
                detached.meta.update(remap[value].meta)
                value = detached
            results.append(value)
    for user in list(block.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if block.users:  # the block's tuple read whole (not seen from export): rebuilt
        with graph.inserting_before(block):
            whole = graph.call_function(tuple, (results,))
        block.replace_all_uses_with(whole)
    graph.erase_node(block)


def _entering(gm: fx.GraphModule, operand: object) -> object:
    """``operand`` as the block reads it: detached (the block records no autograd), unless it is a
    buffer, whose writes the program tracks on the buffer's own node."""
    if not isinstance(operand, fx.Node):
        return operand
    if operand.op == "get_attr":
        value = attribute_at(gm, str(operand.target))
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            return operand
    detached = gm.graph.call_function(without_grad, (operand,))
    detached.meta.update(operand.meta)
    return detached
