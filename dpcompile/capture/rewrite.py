"""Rewrites that make an exported graph a program like the fx frontend's: module calls
restored, mode-aware dropout, mean losses as ``sum / count``, devices read from the inputs,
readable names (both modes served: :mod:`dpcompile.capture.modes`). See :mod:`dpcompile.capture.export`."""

from __future__ import annotations

import logging
import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from dpcompile.analysis.sharding import linear_like_leaves
from dpcompile.errors import TraceError
from dpcompile.runtime.exported import cross_entropy_count, element_count

log = logging.getLogger("dpcompile")
aten = torch.ops.aten



# in-place view ops (BigBird's mask ``einsum(...).unsqueeze_(1)``) change their input's shape, which
# the batch analysis follows by value, not by node: their out-of-place twins, where nothing reads the input after
_INPLACE_VIEWS = {
    aten.unsqueeze_.default: aten.unsqueeze.default, aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.default: aten.squeeze.default, aten.transpose_.default: aten.transpose.int, aten.t_.default: aten.t.default,
}  # fmt: skip


def _last_read_of_its_input(node: fx.Node) -> bool:
    base = node.args[0]
    if not isinstance(base, fx.Node) or base.op == "placeholder":
        return False
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return all(order[user] <= order[node] for user in base.users)


def rewrite(gm: fx.GraphModule, model: nn.Module) -> None:
    """Module calls back where an op is exactly a module's forward; mode-aware dropout; mean
    losses as sum / count; readable names."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        owner_path = node_owner_path(node)
        owner = modules.get(owner_path) if owner_path is not None else None
        if node.target is aten.contiguous.default and len(node.args) == 1 and not node.kwargs:
            # memory layout only (views below become reshapes, which take any layout): the two
            # modes' programs then match where eager code makes a copy contiguous in one only
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if node.target is aten.copy_.default and _writes_itself(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if node.target is aten.view.default:
            node.target = aten.reshape.default
        if node.target in _INPLACE_VIEWS and _last_read_of_its_input(node):
            node.target = _INPLACE_VIEWS[node.target]  # nothing reads the input after: the view, out of place
        if node.target is aten.dropout.default:
            _rewrite_dropout(gm, node, owner_path, owner)
        elif node.target in _MODE_ARGUMENT_DROPOUTS and isinstance(owner, _MODE_ARGUMENT_MODULES) and owner_path:
            _dropout_reads_its_module_mode(gm, node, owner_path)
        elif owner is not None and _is_plain(owner):
            _raise_to_module(gm, node, owner_path, owner)
        elif owner is not None and node.target is aten.addmm.default and _is_plain_leaf(owner):
            _raise_addmm_to_module(gm, node, owner_path, owner)
        elif owner is not None and node.target is aten.matmul.default and _is_transposed_linear(gm, owner, owner_path):
            _raise_matmul_to_module(gm, node, owner_path, owner)
        if node.target is aten.batch_norm.default and not node._erased and isinstance(owner, nn.modules.batchnorm._BatchNorm):
            _batch_norm_in_module_mode(gm, node, owner_path, owner)
        if node.graph is graph and node.op == "call_function" and node.target in _LOSSES:
            _loss_as_sum_over_count(graph, node)
    _devices_from_inputs(graph)
    graph.eliminate_dead_code()
    _readable_names(graph)


def node_owner_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _clean_path(path) if "nn_module_stack" not in path else None


def _clean_path(path: str) -> str:
    """``L['self'].encoder.layer[0]`` or ``encoder.layer.0`` → ``encoder.layer.0``."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = path.replace("._modules.", ".").lstrip(".")
    return path


def _is_plain(module: nn.Module) -> bool:
    """A module whose forward is torch's own and that has no hooks (a call of it is exactly its op). A
    parametrized one is not: its weight is computed (reading ``module.weight`` would run spectral_norm's
    power iteration on the real buffers)."""
    kinds = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if not isinstance(module, kinds) or parametrize.is_parametrized(module):
        return False
    base = next(k for k in kinds if isinstance(module, k))
    own_forward = type(module).forward is base.forward or type(module).forward in (nn.BatchNorm1d.forward,)
    hooks = module._forward_hooks or module._forward_pre_hooks
    return own_forward and not hooks and not isinstance(module, nn.SyncBatchNorm)


def _attr(node: Any) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _is(gm: fx.GraphModule, node: Any, tensor: torch.Tensor | None) -> bool:
    """Whether ``node`` reads exactly ``tensor`` (a None argument matches a None tensor)."""
    if tensor is None:
        return node is None
    target = _attr(node)
    if target is None:
        return False
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
    return obj is tensor


def _raise_to_module(gm: fx.GraphModule, node: fx.Node, path: str, module: nn.Module) -> None:
    args = list(node.args) + [None] * 10
    target = node.target
    if isinstance(module, nn.Linear) and target is aten.linear.default:
        ok = _is(gm, args[1], module.weight) and _is(gm, args[2], module.bias)
    elif isinstance(module, nn.Embedding) and target is aten.embedding.default:
        padding = node.args[2] if len(node.args) > 2 else -1
        ok = (
            _is(gm, args[0], module.weight)
            and module.max_norm is None
            and padding == (module.padding_idx if module.padding_idx is not None else -1)
            and not module.sparse
            and not module.scale_grad_by_freq
        )
        args[1], args[0] = args[0], args[1]  # the module takes the indices
    elif isinstance(module, nn.LayerNorm) and target is aten.layer_norm.default:
        eps = node.args[4] if len(node.args) > 4 else 1e-5
        ok = (
            list(args[1]) == list(module.normalized_shape)
            and _is(gm, args[2], module.weight)
            and _is(gm, args[3], module.bias)
            and eps == module.eps
        )
    elif isinstance(module, nn.modules.batchnorm._BatchNorm) and target is aten.batch_norm.default:
        ok = (
            _is(gm, args[1], module.weight)
            and _is(gm, args[2], module.bias)
            and _is(gm, args[3], module.running_mean)
            and _is(gm, args[4], module.running_var)
            and args[7] == module.eps
        )
        if ok:
            _drop_counter_update(gm, node, module)
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and target in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default):
        ok = module.padding_mode == "zeros" and _is(gm, args[1], module.weight) and _is(gm, args[2], module.bias)
    else:
        ok = False
    if not ok:
        return
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(path, (args[0],))
    call.meta.update(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)


def _is_plain_leaf(module: nn.Module) -> bool:
    """A linear-like leaf (transformers' ``Conv1D``) running its class's own forward, no hooks."""
    leaves = linear_like_leaves()
    if not isinstance(module, leaves):
        return False
    own_forward = any(type(module).forward is kind.forward for kind in leaves)
    return own_forward and not (module._forward_hooks or module._forward_pre_hooks)


def _shape(node: Any) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _raise_addmm_to_module(gm: fx.GraphModule, node: fx.Node, path: str, module: nn.Module) -> None:
    """A Conv1D-like module's forward, ``addmm(bias, x.view(-1, in), weight).view(*x.shape[:-1], out)``
    (weight stored ``(in, out)``), as one call of the module: the sharding analysis shards it
    like a Linear, as on the fx path where it stays a leaf."""
    if len(node.args) != 3 or node.kwargs:
        return  # beta / alpha: not the module's forward
    bias, flat, weight = node.args
    views = (aten.view.default, aten.reshape.default)
    if not (_is(gm, weight, module.weight) and _is(gm, bias, module.bias)):
        return
    if not (isinstance(flat, fx.Node) and flat.op == "call_function" and flat.target in views and node_owner_path(flat) == path):
        return
    if len(flat.users) != 1 or len(node.users) != 1:
        return
    out = next(iter(node.users))
    if not (out.op == "call_function" and out.target in views and node_owner_path(out) == path and out.args[0] is node):
        return
    x = flat.args[0]
    x_shape, out_shape, weight_shape = _shape(x), _shape(out), tuple(module.weight.shape)
    if x_shape is None or out_shape is None or len(weight_shape) != 2 or len(x_shape) < 1:
        return
    if x_shape[-1] != weight_shape[0] or out_shape[-1] != weight_shape[1] or len(out_shape) != len(x_shape):
        return
    if any(a is not b and a != b for a, b in zip(x_shape[:-1], out_shape[:-1])):
        return  # the output view keeps the input's leading dimensions
    with gm.graph.inserting_before(out):
        call = gm.graph.call_module(path, (x,))
    call.meta.update(out.meta)
    out.replace_all_uses_with(call)
    gm.graph.erase_node(out)
    gm.graph.erase_node(node)
    gm.graph.erase_node(flat)


_TRANSPOSED_LINEAR_OPS = (aten.numpy_T.default, aten.t.default, aten.matmul.default, aten.add.Tensor)


def _is_transposed_linear(gm: fx.GraphModule, module: nn.Module, path: str) -> bool:
    """An ``nn.Linear`` subclass whose own forward is ``x @ self.weight.T`` (``+ self.bias``), Falcon's
    ``FalconLinear``: no submodules, no hooks, and every op its forward ran is one of those."""
    if not isinstance(module, nn.Linear) or module._modules or module._forward_hooks or module._forward_pre_hooks:
        return False
    ran = [n for n in gm.graph.nodes if n.op == "call_function" and node_owner_path(n) == path]
    return all(n.target in _TRANSPOSED_LINEAR_OPS for n in ran)


def _raise_matmul_to_module(gm: fx.GraphModule, node: fx.Node, path: str, module: nn.Linear) -> None:
    """``matmul(x, numpy_T(weight))`` (``+ bias``) of a linear-like module, as one call of it: tensor
    parallelism shards it like an ``nn.Linear``, which it computes."""
    x, transposed = node.args[0], node.args[1]
    if node.kwargs or not isinstance(transposed, fx.Node) or transposed.target not in (aten.numpy_T.default, aten.t.default):
        return
    if not _is(gm, transposed.args[0], module.weight) or module.weight.dim() != 2 or len(transposed.users) != 1:
        return
    last = node
    if module.bias is not None:
        add = next(iter(node.users)) if len(node.users) == 1 else None
        if add is None or add.target is not aten.add.Tensor or add.args[0] is not node or not _is(gm, add.args[1], module.bias):
            return
        last = add
    with gm.graph.inserting_before(last):
        call = gm.graph.call_module(path, (x,))
    call.meta.update(last.meta)
    last.replace_all_uses_with(call)
    for done in dict.fromkeys([last, node, transposed]):
        gm.graph.erase_node(done)


def _writes_itself(node: fx.Node) -> bool:
    """``copy_(buf, v)`` where ``v`` is ``buf`` after in-place ops (``v = buf.add_(1)``): export's
    write-back of a buffer forward already changed in place. It changes nothing but the version
    autograd checks (``buf * v`` saved ``buf``), so backward would fail."""
    target, value = node.args[0], node.args[1]
    while isinstance(value, fx.Node) and value.op == "call_function" and value is not target:
        schema = getattr(value.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or not first.alias_info.is_write:
            return False
        value = value.args[0]
    return value is target


def _drop_counter_update(gm: fx.GraphModule, node: fx.Node, module: nn.Module) -> None:
    """The batch norm module counts its batches itself: drop export's ``num_batches_tracked += 1``.
    With ``momentum=None`` the factor export computed from the count (``1 / count.item()``) is read
    only by the op the module call replaces: it reads the count, and dies with that op, as do the
    assertions export specialised the factor with (``Eq(u0, 1)``, the example's count)."""
    if module.num_batches_tracked is None:
        return
    for other in list(gm.graph.nodes):
        if other.op == "call_function" and other.target is aten.add_.Tensor and _is(gm, other.args[0], module.num_batches_tracked):
            other.replace_all_uses_with(other.args[0])
            gm.graph.erase_node(other)
    reads = [n for n in gm.graph.nodes if n.target is aten.item.default and _is(gm, n.args[0], module.num_batches_tracked)]
    while reads:
        for user in list(reads.pop().users):
            reads.append(user)
            if user.target is aten._assert_scalar.default:
                gm.graph.erase_node(user)


def _batch_norm_in_module_mode(gm: fx.GraphModule, node: fx.Node, path: str, module: nn.Module) -> None:
    """A batch norm op left in the graph (its module's forward is a subclass's: ``relu(super().forward(x))``)
    reads its module's mode at run time, as the module's own forward does; export baked in the mode
    it ran in, and the eval program would normalise with batch statistics::

        add_(norm.num_batches_tracked, 1); batch_norm(x, w, b, norm.running_mean, norm.running_var, True, ...)
        → t = getattr(norm, "training"); add_(norm.num_batches_tracked, t); batch_norm(x, w, b, ..., t, ...)

    (the count is added where export ran in eval mode; exported in training without one, forward does
    not count: none is added). Only where the op reads the module's own
    running statistics (without them it normalises with batch statistics in either mode).
    ``momentum=None`` is refused: export fixed the factor of its cumulative average (``1 / count``)."""
    args = list(node.args)
    if len(args) < 6 or module.running_mean is None or not _is(gm, args[3], module.running_mean) or not _is(gm, args[4], module.running_var):
        return
    if module.momentum is None:
        raise TraceError(
            f"'{path}' ({type(module).__name__}) is a batch norm with momentum=None (a cumulative average) and a "
            "forward of its own: the program captured with torch.export would fix the average's factor (1 / count) "
            f"at its value at capture; give it a float momentum (e.g. {type(module).__name__}(..., momentum=0.1)), "
            "or keep torch's forward and apply the rest around the module"
        )
    counter = module.num_batches_tracked
    counters = [
        n for n in gm.graph.nodes
        if counter is not None and n.op == "call_function" and n.target is aten.add_.Tensor and _is(gm, n.args[0], counter)
        and n.args[1] == 1
    ]  # fmt: skip
    first = next(n for n in gm.graph.nodes if n is node or n in counters)
    with gm.graph.inserting_before(first):
        training = gm.graph.call_function(getattr, (gm.graph.get_attr(path), "training"))
        if counter is not None and not counters and not module.training:  # exported in eval mode: training counts too
            counters.append(gm.graph.call_function(aten.add_.Tensor, (gm.graph.get_attr(f"{path}.num_batches_tracked"), 1)))
            counters[0].meta.update(node.meta)
    training.meta.update(stack_trace=node.meta.get("stack_trace"), dpcompile_name=f"{path}_training")
    args[5] = training
    node.args = tuple(args)
    for add in counters:  # eager counts batches in training only
        add.args = (add.args[0], training, *add.args[2:])


def _rewrite_dropout(gm: fx.GraphModule, node: fx.Node, path: str | None, owner: nn.Module | None) -> None:
    """``aten.dropout(x, p, train)`` with the mode read at run time: an ``nn.Dropout`` module is
    called; functional dropout reads its module's ``training``; ``p=0`` is dropped."""
    x, p = node.args[0], node.args[1]
    if p == 0:
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        return
    with gm.graph.inserting_before(node):
        if isinstance(owner, nn.Dropout) and owner.p == p and type(owner).forward is nn.Dropout.forward:
            new = gm.graph.call_module(path, (x,))
        elif owner is not None and path:
            module = gm.graph.get_attr(path)
            training = gm.graph.call_function(getattr, (module, "training"))
            new = gm.graph.call_function(F.dropout, (x, p), {"training": training})
        else:
            return  # forward's own dropout: the mode it was exported in (checked at run time)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


# Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout as export writes them: op(x, p, train)
_MODE_ARGUMENT_DROPOUTS = (aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default)
# ... where the module is the dropout itself: a functional call's constant (F.dropout2d(x, training=True), Monte
# Carlo dropout) is the user's, not the mode; the two-mode export answers for it
_MODE_ARGUMENT_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _dropout_reads_its_module_mode(gm: fx.GraphModule, node: fx.Node, path: str) -> None:
    """``feature_dropout(x, p, True)`` reads the mode of the module it ran in at run time, as the module
    does (export baked the mode in: a program transformed in training kept dropping in eval)::

        feature_dropout(x, 0.3, True)  ->  feature_dropout(x, 0.3, getattr(self.drop, "training"))"""
    if len(node.args) < 3 or not isinstance(node.args[2], bool):
        return
    with gm.graph.inserting_before(node):
        training = gm.graph.call_function(getattr, (gm.graph.get_attr(path), "training"))
    node.args = (*node.args[:2], training, *node.args[3:])


def _devices_from_inputs(graph: fx.Graph) -> None:
    """Export writes the device it ran on into the graph (``arange(n, device='cpu')``,
    ``x.to(dtype, device='cpu')``); the program runs on other devices (the model moves to
    ``devices[0]``, chunks live on every device). A conversion to the tensor's own device keeps
    only its dtype; other device arguments read the device of the first tensor input, per device.
    """
    inputs = [
        n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    device_node: fx.Node | None = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.to.device and len(node.args) >= 3 and not node.kwargs.get("copy", False):
            source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            if isinstance(source, torch.Tensor) and source.device == node.args[1]:
                node.target, node.args = aten.to.dtype, (node.args[0], node.args[2])
                continue
        baked = node.kwargs.get("device")
        if not isinstance(baked, torch.device):
            continue
        if node.target is aten.to.dtype_layout and node.kwargs.get("layout", torch.strided) == torch.strided:
            source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            if isinstance(source, torch.Tensor) and source.device == baked and "dtype" in node.kwargs:
                with graph.inserting_before(node):
                    new = graph.call_function(aten.to.dtype, (node.args[0], node.kwargs["dtype"]))
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                continue
        if not inputs:
            continue
        if device_node is None:
            with graph.inserting_after(inputs[-1]):
                device_node = graph.call_function(getattr, (inputs[0], "device"))
                device_node.meta["dpcompile_name"] = f"{inputs[0].name}_device"
        node.kwargs = {**node.kwargs, "device": device_node}


_LOSSES = {
    aten.cross_entropy_loss.default: "class",
    aten.nll_loss.default: "class",
    aten.nll_loss_nd.default: "class",
    aten.mse_loss.default: "elementwise",
    aten.l1_loss.default: "elementwise",
    aten.smooth_l1_loss.default: "elementwise",
    aten.huber_loss.default: "elementwise",
    aten.binary_cross_entropy.default: "elementwise",
    aten.binary_cross_entropy_with_logits.default: "elementwise",
}
_REDUCTION_AT = {"class": 3, "elementwise": 2}
_MEAN, _SUM = 1, 2


def _loss_as_sum_over_count(graph: fx.Graph, node: fx.Node) -> None:
    """``loss(x, t)`` with ``reduction='mean'`` as ``loss(x, t, reduction='sum') / count``: the
    same value, in a form data parallel reduces exactly (sums and counts over chunks)."""
    kind = _LOSSES[node.target]
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    bound = {a.name: (a.default_value if a.has_default_value() else None) for a in schema.arguments}
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    if bound.get("reduction", _MEAN) != _MEAN:
        return
    if node.target in (aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default) and (
        bound.get("weight") is not None or bound.get("pos_weight") is not None
    ):
        return  # weights broadcast over samples: keep it whole-batch, simple and correct
    if kind == "class" and bound.get("weight") is not None and bound.get("label_smoothing", 0.0):
        return  # PyTorch's weighted, smoothed mean has no simple sum / count form
    at = _REDUCTION_AT[kind]
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > at:
        args[at] = _SUM
    else:
        kwargs["reduction"] = _SUM
    with graph.inserting_after(node):
        total = graph.call_function(node.target, tuple(args), kwargs)
    total.meta.update(node.meta)
    with graph.inserting_after(total):
        if kind == "class":
            count = graph.call_function(cross_entropy_count, (bound["target"], bound.get("weight"), bound.get("ignore_index", -100)))
        else:
            count = graph.call_function(element_count, (bound["self"],))
    count.meta["stack_trace"] = node.meta.get("stack_trace")
    with graph.inserting_after(count):
        mean = graph.call_function(operator.truediv, (total, count))
    mean.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(mean)
    graph.erase_node(node)


def _readable_names(graph: fx.Graph) -> None:
    """Name nodes after the module they run in: ``encoder_layer_0_attn_q_proj`` (a module's
    main op, or a module call) and ``encoder_layer_0_attn_view`` (the rest)."""
    taken = {n.name for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if "dpcompile_name" in node.meta:
            base = node.meta["dpcompile_name"]
        elif node.op == "call_module":
            base = node.target.replace(".", "_")
        elif node.op == "get_attr":
            base = node.target.replace(".", "_")
        else:
            path = node_owner_path(node)
            op = _op_name(node)
            base = f"{path.replace('.', '_')}_{op}" if path else op
        name = _unique(identifier(base), taken)
        taken.add(name)
        if name != node.name:
            node._rename(name)


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.strip("_") or "op"
    return getattr(target, "__name__", "op").strip("_") or "op"


def identifier(name: str) -> str:
    name = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    return f"_{name}" if name[:1].isdigit() else name


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"
