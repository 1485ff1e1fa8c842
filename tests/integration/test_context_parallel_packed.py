"""Packed sequences under context parallelism (``mesh={"cp": N}``): several documents in one row,
with a block-diagonal causal mask built from document ids, or with ``position_ids`` that restart at
each document (Llama's rotary embeddings). Outputs, the loss and every gradient equal eager (float64).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from tests.helpers import assert_lm_step_equals_eager, assert_square_sum_step_equals_eager, model_gradients
from tests.thirdparty import import_or_skip

V = 64  # vocabulary


class PackedAttention(nn.Module):
    """Causal attention within each document of a packed row: the mask is ``same document & causal``."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, doc):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        same = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=(same & causal)[:, None])
        return self.out(a.transpose(1, 2).reshape(b, s, d))


def test_context_parallel_block_diagonal_mask_equals_eager():
    """Documents crossing the shards' borders (length 7 on 3 devices: 3, 2, 2): each device's queries
    see only earlier keys of their own document, on every device; outputs and gradients equal eager."""
    torch.manual_seed(0)
    model = PackedAttention().double()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]])
    pm = dpcompile.transform(model, ["cpu"] * 3, mesh={"cp": 3}, example_inputs=(x, doc))
    assert pm.code.count("dpcompile_runtime_attention_regathered") == 3  # keys and values gathered by each device
    got, want = pm(x, doc), eager(x, doc)
    assert_square_sum_step_equals_eager(model, eager, got, want)


def _packed_inputs(seq: int, first: int, seed: int) -> dict[str, torch.Tensor]:
    """Two documents per row (``first`` tokens, then the rest), positions restarting at the second."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(first), torch.arange(seq - first)]).expand(2, seq).clone()
    return {"input_ids": torch.randint(1, V, (2, seq), generator=g), "position_ids": positions,
            "labels": torch.randint(0, V, (2, seq), generator=g)}  # fmt: skip


@pytest.mark.slow
def test_context_parallel_llama_restarting_position_ids_equal_eager():
    """Llama with position_ids that restart mid-row (rotary tables indexed by them) on 2 devices, a
    length that divides them and one that does not: logits, loss and every gradient equal eager."""
    T = import_or_skip("transformers")
    config = T.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=V, max_position_embeddings=32, use_cache=False,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"cp": 2}, example_kwargs=_packed_inputs(12, 5, 0),
                             frontend="export")  # fmt: skip
    for seq, first in ((12, 5), (13, 8)):
        assert_lm_step_equals_eager(pm, eager, _packed_inputs(seq, first, seq), model_gradients(model))
        model.zero_grad()
        eager.zero_grad()
