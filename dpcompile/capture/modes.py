"""Both modes from one exported program: ``torch.export`` bakes ``model.training`` into the graph
(dropout's ``train=True``, attention's ``dropout_p``, batch norm's running statistics or the batch's).
Where the program exported in the other mode differs only in such constants, each becomes
``mode_value(module, if_training, if_eval)``, read at run time; where it differs in structure
(``if self.training:`` around ops) the program checks the mode it was exported in::

    before: dropout_p = 0.1                                  # exported in training
    after:  dropout_p = mode_value(self.attn, 0.1, 0.0)      # the module's mode at each call
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.capture.rewrite import identifier, node_owner_path
from dpcompile.runtime.exported import expect_mode, mode_value

aten = torch.ops.aten


def _with_defaults(node: fx.Node, n: int) -> None:
    """Spell out an op's omitted positional arguments (their schema defaults) up to ``n``."""
    schema = node.target._schema.arguments
    args = list(node.args)
    while len(args) < n and len(args) < len(schema) and schema[len(args)].has_default_value() and not schema[len(args)].kwarg_only:
        if schema[len(args)].name in node.kwargs:
            break
        args.append(schema[len(args)].default_value)
    node.args = tuple(args)


def merge_modes(gm: fx.GraphModule, other: fx.GraphModule, model: nn.Module, *, training: bool | None = None) -> bool:
    """Make ``gm`` serve both modes where the two programs differ only in Python constants
    (attention's ``dropout_p``): each such constant becomes ``mode_value(module, ...)``. False
    where they differ in structure (``if self.training:`` around ops). ``training``: the mode ``gm``
    was exported in (default: the model's now)."""
    if other is gm:
        return False
    ours = list(gm.graph.nodes)
    theirs = list(other.graph.nodes)
    if len(ours) != len(theirs):
        return False
    pairs: dict[fx.Node, fx.Node] = {}
    changes: list[tuple[fx.Node, int | str, Any, Any]] = []
    for a, b in zip(ours, theirs):
        if a.op == b.op == "call_function" and a.target == b.target and isinstance(a.target, torch._ops.OpOverload):
            _with_defaults(a, len(b.args))
            _with_defaults(b, len(a.args))
        if a.op != b.op or a.target != b.target or len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
            return False
        pairs[b] = a
        slots = [(i, x, y) for i, (x, y) in enumerate(zip(a.args, b.args))] + [(k, a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
        for key, x, y in slots:
            mapped = fx.node.map_arg(y, lambda n: pairs.get(n, n))
            if mapped == x or (isinstance(x, fx.Node) and mapped is x):
                continue
            if type(x) is type(y) and isinstance(x, (bool, int, float)):
                changes.append((a, key, x, y))
                continue
            return False
    training = model.training if training is None else training
    for node, key, value, other_value in changes:
        path = node_owner_path(node) or next(iter(dict(model.named_children())), None)
        if path is None:
            return False
        with gm.graph.inserting_before(node):
            ref = gm.graph.get_attr(path)
            if_training, if_eval = (value, other_value) if training else (other_value, value)
            chosen = gm.graph.call_function(mode_value, (ref, if_training, if_eval))
        chosen.meta["stack_trace"] = node.meta.get("stack_trace")
        if isinstance(key, int) and isinstance(node.target, torch._ops.OpOverload):
            label = node.target._schema.arguments[key].name
        else:
            label = key if isinstance(key, str) else f"arg{key}"
        chosen.meta["dpcompile_name"] = f"{node.name}_{label}"
        if isinstance(key, str):
            node.kwargs = {**node.kwargs, key: chosen}
        else:
            args = list(node.args)
            args[key] = chosen
            node.args = tuple(args)
    for node in gm.graph.nodes:
        if "dpcompile_name" in node.meta and node.op == "call_function" and node.target is mode_value:
            node._rename(identifier(node.meta["dpcompile_name"]))
    return True


_READS_TRAINING: dict[type, bool] = {}
_MODE_AWARE = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.modules.batchnorm._BatchNorm)


def forward_reads_training(cls: type) -> bool:
    """Whether ``cls.forward``'s source, or another method of ``cls`` forward may call (BigBird's
    ``_bigbird_block_rand_mask``: ``if not self.training``), mentions ``training`` (modules the program
    calls as modules read their mode themselves)."""
    if cls not in _READS_TRAINING:
        if issubclass(cls, _MODE_AWARE) and cls.forward in {c.forward for c in _MODE_AWARE}:
            _READS_TRAINING[cls] = False
        else:
            try:
                methods = [inspect.unwrap(getattr(f, "__func__", f)) for n, f in vars(cls).items() if n != "forward"]
                methods = [inspect.unwrap(cls.forward)] + [f for f in methods if inspect.isfunction(f)]
                _READS_TRAINING[cls] = any("training" in inspect.getsource(f) for f in methods)
            except (OSError, TypeError):
                _READS_TRAINING[cls] = True
    return _READS_TRAINING[cls]


_DROPOUTS = (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default)



#: ``gm.meta`` key: forward read a module's ``training`` from code outside the module classes
#: (a helper ``def noisy(m, x): if m.training: ...``), which the classes' sources do not show
READS_MODE_ELSEWHERE = "dpcompile_reads_mode_elsewhere"


@contextlib.contextmanager
def mode_reads_elsewhere(model: nn.Module) -> Iterator[list[str]]:
    """While a frontend captures ``model``: the user's functions that read a module's ``training``
    outside its class's own methods (torch's reads are the modules' own business)."""
    from dpcompile.capture.errors import is_installed_package_file, is_library_file

    reads: list[str] = []
    own = {id(m) for m in model.modules()}

    def read(module: nn.Module) -> bool:
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename
        if id(module) in own and not is_library_file(caller) and not is_installed_package_file(caller):
            if frame.f_locals.get("self") is not module:
                reads.append(f"{caller}:{frame.f_lineno}")
        return module.__dict__["training"]

    def write(module: nn.Module, value: bool) -> None:
        module.__dict__["training"] = value

    nn.Module.training = property(read, write)  # type: ignore[assignment]
    try:
        yield reads
    finally:
        del nn.Module.training


def bakes_mode(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _DROPOUTS and node.args[1] != 0:  # dropout(x, p, train): Dropout1d/2d/3d's feature_dropout too
        return node.target is aten.dropout.default or isinstance(node.args[2], bool)  # else its module's mode, read at run time
    if node.target is aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return p != 0
    if node.target in (aten.batch_norm.default, aten.instance_norm.default):  # running statistics or the batch's
        return len(node.args) > 5 and node.args[3] is not None and isinstance(node.args[5], bool)
    if node.target in _DROPOUTS:
        return False
    return _takes_the_mode(node)  # rrelu(x, lower, upper, training): its slopes drawn in training, fixed in eval


def _takes_the_mode(node: fx.Node) -> bool:
    """An ATen op given the mode as a constant argument named ``training`` or ``train``."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name in ("training", "train"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            return isinstance(value, bool)
    return False


def add_mode_check(gm: fx.GraphModule, model: nn.Module, *, training: bool | None = None) -> None:
    """``gm`` refuses a call in the other mode than ``training`` (default: the model's now)."""
    child = next(iter(dict(model.named_children())), None)
    if child is None:
        return
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        ref = gm.graph.get_attr(child)
        gm.graph.call_function(expect_mode, (ref, model.training if training is None else training))
