"""What a user does next with the composed sequence layouts (``docs/layouts.md``): the calls at the
edges of the shapes the layout was built for, each equal to eager's in float64.

Reuses ``test_compose_sequence``'s tiny GPT-like model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from tests.helpers import full_gradients
from tests.integration.test_compose_sequence import build, lm_batch


@pytest.mark.parametrize("mesh", [{"cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 2}])
def test_first_call_of_one_row_and_one_token_runs_like_eager(mesh):
    """A first call of one row of one token: one piece of the sequence, fewer than cp, so the program
    is built again for it; with batch and sequence both of size 1 the view before attention cannot
    say which dim is the sequence's, and its one piece has no keys to gather from other pieces (it
    was refused as 'cannot run on sequence shards'). Logits, loss and every gradient equal eager's,
    in training and in eval mode."""
    pm, eager = build(1, mesh, rows=2)
    ids, labels = lm_batch(1, 1, seed=4)
    (logits, loss), (want_logits, want_loss) = pm(ids, labels), eager(ids, labels)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)
    (loss + logits.sum()).backward()
    (want_loss + want_logits.sum()).backward()
    grads = full_gradients(pm) if hasattr(pm, "param_shards") else {n: p.grad for n, p in pm.named_parameters()}
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")
    pm.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, labels)[0], eager(ids, labels)[0])


def test_exported_and_loaded_layout_keeps_the_fused_qkv_sections(tmp_path):
    """``dpcompile.export`` then ``dpcompile.load`` of cp x tp: the loaded module's shards of the fused
    qkv are each a slice of q, of k and of v (Megatron's layout), which its ``param_shards`` must say
    (``sections=3``; the export dropped it, so ``state_dict()``, a checkpoint and the gathered gradients
    of the loaded module put q, k and v together wrongly while its calls stayed right)."""
    pm, eager = build(1, {"cp": 2, "tp": 2}, rows=2)
    loaded = dpcompile.load(dpcompile.export(pm, tmp_path / "exported"))
    assert loaded.param_shards["blocks.0.qkv.weight"][0].sections == 3
    state, want = loaded.state_dict(), eager.state_dict()
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
    ids, labels = lm_batch(2, 7, seed=5)
    loaded(ids, labels)[1].backward()
    eager(ids, labels)[1].backward()
    grads = full_gradients(loaded)
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")


@pytest.mark.parametrize("mesh", [{"pp": 2, "tp": 2}, {"cp": 2, "tp": 2}])
def test_sequence_parallel_layout_exports_as_plain_data(mesh, tmp_path):
    """sequence_parallel=True on pp x tp and cp x tp: its runtime calls (the sequence's split,
    reduce-scatter, all-gather, the column layer on the gathered sequence) are in the export's
    vocabulary, so the program is plain data (it was refused: 'a pipeline whose program is not plain
    data'); the loaded module's logits, loss and gradients equal eager's, at another shape too."""
    pm, eager = build(1, mesh, rows=2, sequence_parallel=True)
    folder = dpcompile.export(pm, tmp_path / "exported")
    assert not (folder / "program.pkl").exists()
    loaded = dpcompile.load(folder)
    for rows, seq in ((2, 7), (1, 5)):
        (logits, loss), (want_logits, want_loss) = loaded(*lm_batch(rows, seq, 6)), eager(*lm_batch(rows, seq, 6))
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(loss, want_loss)
    loss.backward()
    want_loss.backward()
    grads = full_gradients(loaded)
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")


class PostNormPair(nn.Module):
    """Two post-norm MLP blocks (BERT's shape); the second's dropout is where a cut can fall, so its
    row layer's output and the residual ``h`` both cross into the next stage."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1, self.fc2, self.norm1 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.LayerNorm(dim)
        self.fc3, self.fc4, self.norm2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.norm1(x + self.fc2(torch.relu(self.fc1(x))))
        return self.norm2(h + self.drop(self.fc4(torch.relu(self.fc3(h)))))


def test_a_residual_sent_across_a_cut_is_split_on_the_sequence_where_it_is_added():
    """``{"pp": 2, "tp": 2}`` with ``sequence_parallel=True``, cut before the dropout: the residual sent
    to stage 1 had no shape record, so stage 1 added the whole of it to each shard's tokens (a
    RuntimeError: the size of tensor a (4) must match the size of tensor b (8))."""
    torch.manual_seed(0)
    model = PostNormPair().double()
    eager = copy.deepcopy(model)
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"pp": 2, "tp": 2}, sequence_parallel=True,
                             pipeline=["drop"], example_inputs=(x,))  # fmt: skip
    torch.manual_seed(1)
    got = pm(x)
    torch.manual_seed(1)
    want = eager(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    grads = full_gradients(pm)
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")
