"""Constructs of the fresh model sweep (issue 30) that used to run whole now run split, in both frontends.

Each toy holds one construct of a model of ``benchmarks/dp_models_sweep_fresh.py``:
``repeat_interleave(k, dim, output_size=...)`` on a dim that is not the batch (Mamba2's groups),
a sequence-first ``(T, B, E)`` viewed as ``(T, B * heads, d)`` (WavLM's
``F.multi_head_attention_forward``), ``mask.type_as(embeddings)`` of a mask of lower rank (Funnel), ``x[:batch_size]`` with the batch
size read from the input (TimeSformer's class tokens), rows of a sequence-first batch times a replicated table
(SpeechT5's relative position bias), per-head weights broadcast over the batch (Zamba's ``x_proj_weight[:, None]``),
``torch.concatenate`` (Zamba), and one batch size over another
(``B // q.shape[0]``, GCViT's windows per image) as the repeat count of ``repeat_interleave``.
Each is captured on a batch of 4, run on a batch of 5 over 3 virtual devices (uneven chunks) and
checked against eager, forward and every gradient; ``explain`` lists nothing that runs whole.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_runs_split_like_eager


class GroupsRepeated(nn.Module):
    """Mamba2: the groups' projections repeated to every head, the output size named."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x):  # (B, L, 2, 4): 2 groups, repeated to 6 heads
        y = self.head(x).repeat_interleave(3, dim=2, output_size=6)
        return y + x.repeat_interleave(3, dim=-2, output_size=6)


class MaskTypeAs(nn.Module):
    """Funnel: the attention mask converted to the embeddings' dtype, then used per sample."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):  # (B, L, 8)
        mask = (x.sum(-1) > 0).type_as(x)  # (B, L): lower rank than x
        scales = torch.arange(8).type_as(x)  # PEGASUS-X: a replicated x in a split y's dtype
        return self.head(x) * mask[..., None] + mask.type_as(self.head.weight)[..., None] + scales


class SliceToBatchSize(nn.Module):
    """TimeSformer: ``embeddings[:batch_size, 0]``, the batch size read from the input."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):  # (B, L, 8)
        batch_size = x.shape[0]
        h = self.head(x)
        cls = h[:batch_size, 0, :].unsqueeze(1)
        return torch.cat((cls, h), dim=1)


class WindowsPerImage(nn.Module):
    """GCViT: a global query per image repeated to each of its windows, the count read as a
    ratio of two batch sizes (``B // q.shape[0]``)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):  # (B, 4, 4, 4): an image of 2 x 2 windows of 2 x 2 pixels, 4 channels
        B = x.shape[0]
        windows = x.view(B, 2, 2, 2, 2, 4).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, 4)  # (B * 4, 4, 4)
        q = self.q(x.mean((1, 2)))[:, None, :]  # (B, 1, 4)
        q = q.repeat_interleave(windows.shape[0] // q.shape[0], dim=0)  # (B * 4, 1, 4)
        attn = (q @ windows.transpose(-2, -1)).softmax(-1)
        return (attn @ windows).reshape(B, 4, 4)


class HeadsFoldedSequenceFirst(nn.Module):
    """WavLM (``F.multi_head_attention_forward``): a sequence-first ``(T, B, E)`` viewed as
    ``(T, B * heads, E // heads)``, the heads folded into the batch on dim 1."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):  # (B, T, 8)
        h = self.head(x).transpose(0, 1)  # (T, B, 8)
        T, B, E = h.shape
        q = h.reshape(T, B * 2, 4).transpose(0, 1)  # (B * 2, T, 4)
        a = torch.bmm(q, q.transpose(1, 2)).softmax(-1)
        o = torch.bmm(a, q).view(B, 2, T, 4).transpose(1, 2)
        return self.head(o.reshape(B, T, E))


class RelativePositionBias(nn.Module):
    """SpeechT5: the queries sequence-first, ``(T, B, D)``, times a replicated ``(T, D, T)`` position table,
    the batch in the rows of a batch of matrices."""

    def __init__(self):
        super().__init__()
        self.q, self.positions = nn.Linear(8, 8), nn.Parameter(torch.randn(5, 5, 8))

    def forward(self, x):  # (B, 5, 8)
        bias = torch.matmul(self.q(x).transpose(0, 1), self.positions.transpose(-2, -1))  # (T, B, T)
        return bias.transpose(0, 1)


class HeadWeightsBroadcast(nn.Module):
    """Zamba: per-head weights broadcast over the batch, ``(H, 1, r, d) @ (H, B, d, L)``."""

    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(2, 3, 4))

    def forward(self, x):  # (B, 2, 4, 5): heads second
        return torch.tanh(self.weights[:, None] @ x.transpose(0, 1)).transpose(0, 1)


class ConcatenateAlias(nn.Module):
    """Zamba: ``torch.concatenate``, an alias of ``cat`` torch.export keeps under its own name."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, L, 4)
        return self.head(torch.concatenate([x, x * 2], dim=-1))


CASES = {
    "heads_folded_sequence_first": (HeadsFoldedSequenceFirst, (6, 8)),
    "repeat_interleave_output_size": (GroupsRepeated, (3, 2, 4)),
    "mask_type_as": (MaskTypeAs, (6, 8)),
    "concatenate_alias": (ConcatenateAlias, (3, 4)),
    "head_weights_broadcast": (HeadWeightsBroadcast, (2, 4, 5)),
    "relative_position_bias": (RelativePositionBias, (5, 8)),
    "slice_to_batch_size": (SliceToBatchSize, (6, 8)),
    "windows_per_image": (WindowsPerImage, (4, 4, 4)),
}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fresh_construct_runs_split_and_equals_eager(name, frontend):
    """Forward and every gradient equal eager on uneven chunks; nothing runs whole, every FLOP split."""
    assert_runs_split_like_eager(*CASES[name], frontend)
