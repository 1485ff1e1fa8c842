"""``decompose_attention``: an ``nn.MultiheadAttention`` call written out as its functional parts.

Tensor parallelism shards attention by heads, which it can only do where the heads are
visible: a self-attention call of ``nn.MultiheadAttention`` (a leaf the tracer keeps as one
call, as in torchvision's ViT) becomes its fused in-projection (``F.linear`` on
``in_proj_weight``), a ``chunk`` into q, k, v, per-head views,
``F.scaled_dot_product_attention`` and ``out_proj``, so ``shard_linear`` shards the
in-projection per section (whole heads of q, k and v on each shard) and ``out_proj`` by rows.

Before::

    def forward(self, x):
        attn = self.attn(x, x, x, need_weights=False)
        getitem = attn[0]
        return getitem

After (``batch_first=True``, 4 heads of 16)::

    def forward(self, x):
        attn_shape = x.shape
        attn_batch = attn_shape[0]
        attn_seq = attn_shape[1]
        attn_in_proj_weight = self.attn.in_proj_weight
        attn_in_proj_bias = self.attn.in_proj_bias
        attn_qkv = torch._C._nn.linear(x, attn_in_proj_weight, attn_in_proj_bias)
        attn_chunk = attn_qkv.chunk(3, dim = -1)
        ...
        attn_q = attn_q_part.view(attn_batch, attn_seq, 4, 16).transpose(1, 2)
        ...
        attn_sdpa = torch._C._nn.scaled_dot_product_attention(attn_q, attn_k, attn_v, dropout_p = 0.0)
        attn_sdpa_t = attn_sdpa.permute(2, 0, 1, 3)
        attn_merged = attn_sdpa_t.reshape(attn_seq, attn_batch, 64)    # (T, B, E), as the module merges
        attn_out_proj_weight = self.attn.out_proj.weight
        attn_out_proj_bias = self.attn.out_proj.bias
        attn_out_t = torch._C._nn.linear(attn_merged, attn_out_proj_weight, attn_out_proj_bias)
        attn = attn_out_t.transpose(0, 1)                                # (B, T, E) laid out as eager's
        return attn

Only plain self-attention is rewritten (the same tensor as query, key and value, no masks,
no ``bias_k``/``add_zero_attn``, the attention weights unused); any other call stays one
call, and ``info["kept"]`` says why, for ``pm.plan_reasons``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dpcompile.infra import PassResult, stamp

PASS = "decompose_attention"


def why_not_decomposable(node: fx.Node, mha: nn.MultiheadAttention) -> str | None:
    """Why the call ``node`` of ``mha`` cannot be written out as sharded-by-heads parts; None if it can."""
    args = list(node.args) + [None] * (3 - len(node.args))
    query = args[0]
    key = args[1] if len(node.args) > 1 else node.kwargs.get("key")
    value = args[2] if len(node.args) > 2 else node.kwargs.get("value")
    if not (query is key is value):
        return "it is not self-attention (query, key and value differ), which is only sharded by heads as self-attention"
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        return "it has separate q/k/v projections, bias_k/bias_v or add_zero_attn"
    extra = {k: v for k, v in node.kwargs.items() if k not in ("key", "value", "need_weights", "query")}
    if len(node.args) > 3 or any(v is not None and v is not False for v in extra.values()):
        return "it is called with a mask or other options (key_padding_mask=, attn_mask=, is_causal=)"
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1)):
            return "its result is used other than as (output, weights)"
        if user.args[1] == 1 and user.users:
            return "its attention weights are used (need_weights)"
    return None


def decompose_attention(gm: fx.GraphModule, *, dropping_only: bool = False) -> PassResult:
    """Write each plain self-attention call of an ``nn.MultiheadAttention`` out as functional parts.

    ``dropping_only``: only the calls whose attention dropout draws (``dropout > 0`` in training),
    so that its ``scaled_dot_product_attention`` is a random site every layout draws exactly: the
    module's own call draws inside, where a micro-batch or a checkpointed region cannot draw its
    slice of the single-device mask in the single-device order.
    ``info["decomposed"]`` lists the module paths rewritten, ``info["kept"]`` maps the others
    to the reason they stay one call.
    """
    modules = dict(gm.named_modules())
    decomposed: list[str] = []
    kept: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.MultiheadAttention):
            continue
        mha = modules[node.target]
        if dropping_only and not (mha.dropout and mha.training):
            continue
        why = why_not_decomposable(node, mha)
        if why is not None:
            kept[node.target] = why
            continue
        written: list[fx.Node] = []
        with gm.graph.inserting_before(node):
            out = _write_out(gm.graph, node, mha, written)
        _record_fake_values(gm, node, written)
        for user in list(node.users):
            if user.args[1] == 0:
                user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        decomposed.append(node.target)
    return PassResult(gm, bool(decomposed), {"decomposed": decomposed, "kept": kept})


def _record_fake_values(gm: fx.GraphModule, node: fx.Node, written: list[fx.Node]) -> None:
    """Where shapes were propagated (the call's input has a fake value), the written-out nodes get
    theirs too: the batch rules read them (a call written out after ``propagate_shapes``)."""
    x = node.args[0] if node.args else node.kwargs.get("query")
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, FakeTensor):
        return
    mode = val.fake_mode
    try:
        with mode:
            for n in written:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
                if n.op == "get_attr":
                    value = gm.get_parameter(str(n.target))
                    n.meta["val"] = value if isinstance(value, FakeTensor) else mode.from_tensor(value)
                elif n.op == "call_method":
                    n.meta["val"] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
                else:
                    n.meta["val"] = n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - shapes are a refinement: without them the batch rules are cautious
        for n in written:
            n.meta.pop("val", None)


def _write_out(graph: fx.Graph, node: fx.Node, mha: nn.MultiheadAttention, written: list[fx.Node]) -> fx.Node:
    path, name = node.target, node.name
    heads, embed = mha.num_heads, mha.embed_dim
    head_dim = embed // heads
    x = node.args[0] if node.args else node.kwargs["query"]

    def make(op: str, target: Any, args: tuple, kwargs: dict | None = None, suffix: str = "") -> fx.Node:
        new = graph.create_node(op, target, args, kwargs or {}, name=f"{name}_{suffix}" if suffix else name)
        written.append(new)
        return stamp(new, PASS, node)

    shape = make("call_function", getattr, (x, "shape"), suffix="shape")
    batch_at, seq_at = (0, 1) if mha.batch_first else (1, 0)
    batch = make("call_function", operator.getitem, (shape, batch_at), suffix="batch")
    seq = make("call_function", operator.getitem, (shape, seq_at), suffix="seq")
    w = make("get_attr", f"{path}.in_proj_weight", (), suffix="in_proj_weight")
    b = make("get_attr", f"{path}.in_proj_bias", (), suffix="in_proj_bias") if mha.in_proj_bias is not None else None
    qkv = make("call_function", F.linear, (x, w, b), suffix="qkv")
    chunk = make("call_method", "chunk", (qkv, 3), {"dim": -1}, suffix="chunk")
    parts = []
    for i, part in enumerate("qkv"):
        piece = make("call_function", operator.getitem, (chunk, i), suffix=f"{part}_part")
        if mha.batch_first:  # (B, T, E) -> (B, T, H, d) -> (B, H, T, d)
            view = make("call_method", "view", (piece, batch, seq, heads, head_dim), suffix=f"{part}_heads")
            parts.append(make("call_method", "transpose", (view, 1, 2), suffix=part))
        else:  # (T, B, E) -> (T, B, H, d) -> (B, H, T, d)
            view = make("call_method", "view", (piece, seq, batch, heads, head_dim), suffix=f"{part}_heads")
            parts.append(make("call_method", "permute", (view, 1, 2, 0, 3), suffix=part))
    dropout = mha.dropout if mha.training else 0.0
    y = make("call_function", F.scaled_dot_product_attention, tuple(parts), {"dropout_p": dropout}, suffix="sdpa")
    # merged (T, B, E) as the module merges it: a batch_first output is (B, T, E) laid out as
    # (T, B, E), as eager's is, and a dropout on it draws its mask in that memory order (ViT's)
    t = make("call_method", "permute", (y, 2, 0, 1, 3), suffix="sdpa_t")
    merged = make("call_method", "reshape", (t, seq, batch, embed), suffix="merged")
    ow = make("get_attr", f"{path}.out_proj.weight", (), suffix="out_proj_weight")
    ob = make("get_attr", f"{path}.out_proj.bias", (), suffix="out_proj_bias") if mha.out_proj.bias is not None else None
    if not mha.batch_first:
        return make("call_function", F.linear, (merged, ow, ob), suffix="out")
    out = make("call_function", F.linear, (merged, ow, ob), suffix="out_t")
    return make("call_method", "transpose", (out, 0, 1), suffix="out")


__all__ = ["PASS", "decompose_attention", "why_not_decomposable"]
