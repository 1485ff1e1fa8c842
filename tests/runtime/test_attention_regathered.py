"""``runtime.attention_regathered``: one device's attention against every device's key and value shards,
gathered again in backward. Outputs and gradients equal whole-sequence attention; what backward keeps
is the device's own rows, never the gathered keys and values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpcompile.runtime import attention_regathered


def _qkv(seq: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(2, 3, seq, 4, dtype=dtype, generator=g).requires_grad_() for _ in range(3))


def _per_device(q, k, v, sizes, causal: bool, **kwargs):
    """Every device's rows of the output, each from its own queries and all the shards, in order."""
    qs, ks, vs = q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)
    outs, start = [], 0
    for i, rows in enumerate(sizes):
        positions = torch.arange(start, start + rows) if causal else None
        outs.append(attention_regathered(qs[i], ks, vs, 2, "cpu", positions, **kwargs))
        start += rows
    return outs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sizes", [(3, 2, 2), (1, 5), (4, 4, 4, 4), (6,)])
def test_causal_over_shards_equals_whole_attention(sizes, dtype):
    """Causal on CPU: each shard's rows and every gradient equal is_causal attention over the whole
    sequence (uneven shards, a one-row shard, one device), and no shard's call pads or recomputes."""
    q, k, v = _qkv(sum(sizes), dtype)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4)
    outs = _per_device(q, k, v, sizes, causal=True, scale=0.4)
    assert all(type(o.grad_fn).__name__ == "_CausalOverShardsBackward" for o in outs)
    got = torch.cat(outs, 2)
    torch.testing.assert_close(got, whole)
    weight = torch.randn_like(whole)
    want_grads = torch.autograd.grad((whole * weight).sum(), (q, k, v))
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad {name}: {m}")


def test_masked_attention_recomputed_equals_whole_attention():
    """With a mask (padding on the first shard's keys, its gradient too): gathered and recomputed in
    backward, equal to whole-sequence attention, outputs and gradients of q, k, v and the mask."""
    q, k, v = _qkv(7)
    bias = torch.zeros(2, 1, 7, 7, dtype=torch.float64)
    bias[0, :, :, 1:3] = -1e9
    bias = (bias + torch.randn(2, 1, 7, 7, dtype=torch.float64)).requires_grad_()
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    rows = bias.split((4, 3), 2)
    qs, ks, vs = q.split((4, 3), 2), k.split((4, 3), 2), v.split((4, 3), 2)
    got = torch.cat([attention_regathered(qs[i], ks, vs, 2, "cpu", attn_mask=rows[i]) for i in range(2)], 2)
    torch.testing.assert_close(got, whole)
    weight = torch.randn_like(whole)
    want_grads = torch.autograd.grad((whole * weight).sum(), (q, k, v, bias))
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v, bias))
    for name, a, b in zip(("q", "k", "v", "mask"), got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("causal", [True, False])
def test_backward_keeps_no_gathered_keys_or_values(causal):
    """What autograd saves for backward is the shards' length along the sequence, never the whole
    sequence's (8 here): the gathered keys and values are made again in backward. The same attention
    on keys gathered outside (what context parallel did before) saves them whole."""
    q, k, v = _qkv(8)
    lengths: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            lengths.append(t.shape[2])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _per_device(q, k, v, (4, 4), causal=causal)
    assert 8 not in lengths
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q[:, :, 4:], torch.cat(k.split(4, 2), 2), v, is_causal=False)
    assert 8 in lengths  # the test sees gathered keys where they are kept
