"""transformers families beyond the ones the other model tests hold (ALBERT, BART, Whisper, Phi,
Gemma 2, CLIP, ...), tiny configs with random weights, float64: what once failed on them.

- ``activation_checkpointing=True`` on a model whose blocks are one-item lists: ALBERT's one layer
  group run by every layer, a one-layer encoder-decoder's ``layers.0`` on each side.
- tensor parallelism through DeBERTa-v2's loss, whose rows are gathered by a ``nonzero`` index.
- a pipeline's exact dropout where a stage runs Phi's two ``resid_dropout`` calls out of order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.analysis.checkpoint_regions import checkpoint_paths
from tests.helpers import full_gradients
from tests.thirdparty import import_or_skip

V = 32


class SharedBlockStack(nn.Module):
    """ALBERT's shape: a one-item ``ModuleList`` whose block every layer runs."""

    def __init__(self, d: int = 8, layers: int = 3):
        super().__init__()
        self.groups = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh())])
        self.layers = layers
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for _ in range(self.layers):
            x = self.groups[0](x)
        return self.head(x).pow(2).mean()


def _assert_step_equals_eager(pm, model, eager, *args, **kwargs):
    got, want = pm(*args, **kwargs), eager(*args, **kwargs)
    got, want = (got, want) if isinstance(got, torch.Tensor) else (got.loss, want.loss)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_checkpointing_true_recomputes_a_lone_block_every_layer_runs():
    """True on blocks in a one-item list recomputes that item at each of its runs (it was refused)."""
    torch.manual_seed(0)
    model = SharedBlockStack().double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True)
    assert pm.strategies["activation_checkpointing"] == "recompute in backward: groups.0"
    assert "dpcompile_runtime_checkpoint(groups_0" in pm.code
    _assert_step_equals_eager(pm, model, eager, torch.randn(6, 8, dtype=torch.float64))


def test_checkpointing_true_picks_albert_and_one_layer_bart_blocks():
    """The blocks True recomputes on ALBERT (its one layer group, not the one-item list inside it) and
    on a one-layer BART (each side's layer); a whole ALBERT step recomputing it equals eager's
    (float64, 2 virtual devices) in the probes, a capture too slow for the suite."""
    T = import_or_skip("transformers")
    albert = T.AlbertModel(T.AlbertConfig(vocab_size=V, embedding_size=8, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16))  # fmt: skip
    assert checkpoint_paths(albert, True) == ("encoder.albert_layer_groups.0",)
    bart = T.BartModel(T.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                    max_position_embeddings=16))  # fmt: skip
    assert checkpoint_paths(bart, True) == ("encoder.layers.0", "decoder.layers.0")
    two_layers = T.BartModel(T.BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=1,
                                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                          decoder_ffn_dim=32, max_position_embeddings=16))  # fmt: skip
    assert checkpoint_paths(two_layers, True) == ("encoder.layers.0", "encoder.layers.1")  # the largest list, as before


class LabelledRowsLoss(nn.Module):
    """DeBERTa-v2's classification loss: the logits of the rows whose label is not negative,
    ``gather``ed by an index ``nonzero`` counts (a size known only at run time)."""

    def __init__(self, d: int = 8, labels: int = 4):
        super().__init__()
        self.body, self.head = nn.Linear(d, d), nn.Linear(d, labels)

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.body(x)))
        index = (labels >= 0).nonzero()
        labelled = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
        return nn.functional.cross_entropy(labelled, torch.gather(labels, 0, index.view(-1)))


def test_tensor_parallel_gathers_rows_by_a_nonzero_count_as_eager():
    """A column-sharded head's logits gathered by a ``nonzero`` index (DeBERTa-v2's loss): the sharding
    analysis no longer asks the run-time count whether it equals the shard extent (a guard error);
    the loss and every gradient equal eager's."""
    torch.manual_seed(0)
    model = LabelledRowsLoss().double()
    eager = copy.deepcopy(model)
    x, labels = torch.randn(6, 8, dtype=torch.float64), torch.tensor([0, -1, 3, 2, -1, 1])
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel={"body": "column", "head": "column"},
                             example_inputs=(x, labels), frontend="export")  # fmt: skip
    got, want = pm(x, labels), eager(x, labels)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    grads = full_gradients(pm)
    for name, q in eager.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class TwoDropoutsOneWhole(nn.Module):
    """Phi's parallel block, reduced: one ``nn.Dropout`` called on two branches, the first of which
    reads a value of the whole batch (Phi's attention reads its mask, made on the gathered batch)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.attn, self.mlp, self.drop, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.5), nn.Linear(d, 2)

    def forward(self, x):
        attended = self.drop(self.attn(x - x.mean(0)))
        return self.head(torch.tanh(attended + self.drop(self.mlp(x)))).pow(2).mean()


class TwoDropoutsOneByPosition(TwoDropoutsOneWhole):
    """The same, the first branch reading each row's place in the batch (``arange`` of the batch size,
    as Phi's causal mask is indexed): micro-batch 0's piece waits for every micro-batch's size."""

    def forward(self, x):
        rows = torch.arange(x.size(0), dtype=x.dtype).view(-1, 1).expand(x.size(0), x.size(1))
        attended = self.drop(self.attn(x) + rows)
        return self.head(torch.tanh(attended + self.drop(self.mlp(x)))).pow(2).mean()


@pytest.mark.parametrize(("model_type", "devices", "layout"), [
    (TwoDropoutsOneWhole, 2, {"pipeline": ["head"], "micro_batches": 2}),
    (TwoDropoutsOneWhole, 4, {"mesh": {"pp": 2, "dp": 2}, "pipeline": ["head"], "micro_batches": 2}),
    (TwoDropoutsOneByPosition, 2, {"pipeline": ["head"], "micro_batches": 2, "schedule": "1F1B"}),
    (TwoDropoutsOneWhole, 4, {"mesh": {"dp": 2, "tp": 2}}),
])  # fmt: skip
def test_pipeline_draws_dropout_sites_in_the_models_order(model_type, devices, layout):
    """A stage runs micro-batch 0's second dropout before its first (the first waits for the whole
    batch, or every micro-batch's size); dp x tp's copies run the same lowering: each site still
    draws its whole mask in the model's order, so the loss and every gradient equal eager's from the
    same seed (micro-batch 0's order drew the masks swapped)."""
    torch.manual_seed(0)
    model = model_type().double()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * devices, **layout)
    torch.manual_seed(5)
    got = pm(x)
    torch.manual_seed(5)
    want = eager(x)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    grads = full_gradients(pm) if getattr(pm, "param_shards", None) else {n: p.grad for n, p in model.named_parameters()}
    for name, q in eager.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
