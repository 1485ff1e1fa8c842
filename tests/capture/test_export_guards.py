"""A program captured with torch.export (frontend="export") baked in what forward read: every
change to it, at any depth of the module tree, and every call whose shapes, dtypes or None
pattern the program does not fit, is refused with a DpCompileError naming it (docs/guards.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile


class Block(nn.Module):
    """Reads an attribute (``scaling``) and a dtype constant export bakes in (``finfo(...).bits``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.scaling = 1.0

    def forward(self, x):
        bits = torch.finfo(self.fc.weight.dtype).bits  # fx cannot trace this: export captures it
        return self.act(self.fc(x)) * self.scaling * (bits / 32)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _exported_stack():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    return model, pm, x


def _swap_activation(model):
    old = model.layers[1].act
    model.layers[1].act = nn.ReLU()
    return lambda: setattr(model.layers[1], "act", old)


def _set_scaling(model):
    model.layers[1].scaling = 2.0
    return lambda: setattr(model.layers[1], "scaling", 1.0)


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda m: m.layers[1].register_forward_hook(lambda mod, a, out: out * 3).remove, "hook added to or removed from 'layers.1'"),
        (lambda m: m.layers[0].act.register_forward_hook(lambda mod, a, out: out * 3).remove, "'layers.0.act'"),
        (_set_scaling, "attribute 'layers.1.scaling'"),
        (_swap_activation, "'layers.1.act'"),
    ],
    ids=["block_hook", "traced_through_leaf_hook", "block_attribute", "swapped_activation"],
)
def test_export_guard_change_inside_a_module_list_is_refused_and_undoing_it_runs(change, named):
    """encoder.layer.N-style blocks: a hook, an attribute forward reads, a swapped submodule are named, never skipped."""
    model, pm, x = _exported_stack()
    undo = change(model)
    with pytest.raises(dpcompile.DpCompileError, match=f"changed since transform: .*{named}.*transform again"):
        pm(x)
    undo()
    torch.testing.assert_close(pm(x), model(x))


def test_export_guard_hook_on_a_called_module_runs_at_call_time():
    """A hook on a module the program calls (nn.Linear, lowered back to a call) runs per call, as in eager."""
    model, pm, x = _exported_stack()
    model.layers[1].fc.register_forward_hook(lambda mod, a, out: out * 3)
    torch.testing.assert_close(pm(x), model(x))


def test_export_guard_model_double_is_refused_and_export_too(tmp_path):
    """model.double() after capture: the baked-in finfo(...).bits == 32 is not run stale, and export refuses the program."""
    model, pm, x = _exported_stack()
    model.double()
    with pytest.raises(dpcompile.DpCompileError, match=r"'layers.0.fc.weight' is torch.float64 .* captured as torch.float32"):
        pm(x.double())
    with pytest.raises(dpcompile.DpCompileError, match="changed since transform"):
        dpcompile.export(pm, tmp_path / "out")
    again = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x.double(),))
    torch.testing.assert_close(again(x.double()), model(x.double()))



def test_export_guard_a_tensor_parallel_program_converted_is_refused_naming_its_shard():
    """pm.double() of a tensor-parallel program converts its own shards, not the model's tensors the guard
    watched. Before, the call ran the program that baked in float32 and failed inside it (a RuntimeCallFailed,
    "mat1 and mat2 must have the same dtype"); now it is refused as the data-parallel program's change is."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, mesh={"tp": 2}, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.double()
    for call in (x, x.double()):  # before: a RuntimeCallFailed from inside the program, an InputMismatch
        with pytest.raises(dpcompile.ModelChanged, match=r"the program's '.*_shard0' is torch.float64 on cpu, captured as torch.float32"):
            pm(call)
    pm.float()
    torch.testing.assert_close(pm(x), model(x))

class Positions(nn.Module):
    """BERT-style: a position table sliced to the sequence length, an optional mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.positions = nn.Parameter(torch.randn(16, 32))
        self.fc = nn.Linear(32, 32)

    def forward(self, input_ids, attention_mask=None):
        seq = input_ids.shape[1]
        h = self.embed(input_ids) + self.positions[:seq]
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return self.fc(h)


def _ids(batch, seq):
    return torch.randint(0, 50, (batch, seq))


def test_export_guard_other_sequence_length_is_refused_naming_the_shapes():
    """Captured with 8 tokens, called with 1 or 12: a DpCompileError with both shapes (never (4, 8, 32) by broadcasting)."""
    torch.manual_seed(0)
    model = Positions()
    kwargs = {"input_ids": _ids(4, 8), "attention_mask": torch.ones(4, 8)}
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_kwargs=kwargs)
    for seq in (1, 12):
        with pytest.raises(dpcompile.DpCompileError, match=rf"'input_ids' has shape \(4, {seq}\).*shape \(\*, 8\).*dynamic_dims="):
            pm(input_ids=_ids(4, seq), attention_mask=torch.ones(4, seq))
    with pytest.raises(dpcompile.DpCompileError, match="'attention_mask' is None.*tensor of shape"):
        pm(input_ids=_ids(4, 8), attention_mask=None)
    with pytest.raises(dpcompile.DpCompileError, match="'attention_mask' is missing.*tensor of shape"):
        pm(input_ids=_ids(4, 8))  # left to forward's default: the program has no path without it
    with pytest.raises(dpcompile.DpCompileError, match="'attention_mask' is torch.float64.*captured by torch.export for torch.float32"):
        pm(input_ids=_ids(4, 8), attention_mask=torch.ones(4, 8, dtype=torch.float64))
    ids = _ids(4, 8)
    torch.testing.assert_close(pm(input_ids=ids, attention_mask=torch.ones(4, 8)), model(ids, torch.ones(4, 8)))


def test_export_guard_dynamic_dims_serves_every_sequence_length():
    """dynamic_dims={'input_ids': [1], ...}: one program for every length the position table holds."""
    torch.manual_seed(0)
    model = Positions()
    kwargs = {"input_ids": _ids(4, 8), "attention_mask": torch.ones(4, 8)}
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_kwargs=kwargs, dynamic_dims=[1])
    for seq in (1, 5, 12):
        ids, mask = _ids(4, seq), torch.ones(4, seq)
        out = pm(input_ids=ids, attention_mask=mask)
        assert out.shape == (4, seq, 32)
        torch.testing.assert_close(out, model(ids, mask))


class PositionList(nn.Module):
    """Funnel's pattern: the length becomes a Python list, so export fixes the dim to the example's."""

    def forward(self, x):
        return x + torch.tensor(list(range(x.shape[1])), dtype=x.dtype)[:, None]


class Blocks(nn.Module):
    """LongT5's pattern: padding only where the length is not a multiple of the block, then blocks."""

    def forward(self, x):
        if x.shape[1] % 3:
            x = nn.functional.pad(x, (0, 0, 0, 3 - x.shape[1] % 3))
        return x.reshape(x.shape[0], x.shape[1] // 3, 3 * x.shape[2]).sum(-1)


@pytest.mark.parametrize(
    ("model", "line"), [(PositionList(), r"test_export_guards.py:\d+ in forward"), (Blocks(), r"test_export_guards.py:\d+ in forward: return x.reshape")]
)
def test_export_guard_dynamic_dims_the_model_fixes_is_refused_at_transform_naming_dim_and_line(model, line):
    """dynamic_dims=[1] on code that fixes the length (a list of it, or a branch on it) is refused at transform,
    naming the dim and the line, instead of a bare RuntimeError inside the program at the next length."""
    with pytest.raises(dpcompile.TraceError, match=rf"dim 1 of 'x' varies.*{line}.*Leave dim 1 out of dynamic_dims="):
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(2, 6, 4),), dynamic_dims=[1])
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(2, 6, 4),))
    with pytest.raises(dpcompile.InputMismatch, match=r"shape \(2, 7, 4\).*\(\*, 6, 4\)"):
        pm(torch.randn(2, 7, 4))


class Contrastive(nn.Module):
    """CLIP's contrastive loss: ``torch.arange(len(logits))``, a Python int of the batch, fixes it in export."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        logits = self.fc(x) @ x.T
        return nn.functional.cross_entropy(logits, torch.arange(len(logits)))


@pytest.mark.filterwarnings("ignore:dpcompile. 50% of forward FLOPs")
def test_export_guard_batch_the_model_fixes_names_the_code_not_dynamic_dims():
    """A batch dim the model's code fixes (CLIP's ``len(logits)``) is refused at another batch with the way out
    that works; before, the message said to pass dynamic_dims= (which is then refused) or an example batch of 2
    or more (it was 4)."""
    model = Contrastive()
    x = torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(dpcompile.InputMismatch, match=r"shape \(3, 4\).*dim 0: 3 vs 4.*code fixed that dim") as refused:
        pm(torch.randn(3, 4))
    assert "dynamic_dims={" not in str(refused.value) and "batch of 2 or more" not in str(refused.value)


def test_export_guard_example_batch_of_one_then_four_is_refused():
    """An example batch of 1 fixes the batch dim: a call with 4 is named, with the way out."""
    torch.manual_seed(0)
    model = Positions()
    with pytest.warns(UserWarning, match="specialised the batch dim"):
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_kwargs={"input_ids": _ids(1, 8)})
    with pytest.raises(dpcompile.DpCompileError, match=r"'input_ids' has shape \(4, 8\).*shape \(1, 8\).*dim 0: 4 vs 1"):
        pm(input_ids=_ids(4, 8))
    with pytest.raises(dpcompile.DpCompileError, match="captured by torch.export without 'attention_mask'.*example_kwargs="):
        pm(input_ids=_ids(1, 8), attention_mask=torch.ones(1, 8))


class ScaledInner(nn.Module):
    """Falcon/DeBERTa-v2-style: a tensor made in a submodule's forward, which torch.export lifts."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        scale = torch.tensor(0.5)
        if x.shape[-1] > 4:  # a shape branch: fx cannot trace it, export captures it
            return self.fc(x) * scale
        return x


class TwoScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ScaledInner()
        self.inner2 = ScaledInner()

    def forward(self, x):
        return self.inner2(self.inner(x))


def test_export_capture_tensor_constant_made_inside_a_submodule_forward():
    """export lifts it as inner.lifted_tensor_0: the program holds it (not in state_dict), runs, and copies."""
    import copy

    torch.manual_seed(0)
    model, x = TwoScaled(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    assert pm.state_dict().keys() == model.state_dict().keys()
    torch.testing.assert_close(copy.deepcopy(pm)(x), model(x))


class CachedBias(nn.Module):
    """timm's LeViT/EfficientFormer attention-bias cache: filled per device in eval, emptied by train()."""

    def __init__(self, shape_branch: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attention_biases = nn.Parameter(torch.randn(8))
        self.register_buffer("idxs", torch.arange(8).flip(0), persistent=False)
        self.attention_bias_cache = {}
        self.shape_branch = shape_branch

    @torch.no_grad()
    def train(self, mode=True):
        super().train(mode)
        if mode and self.attention_bias_cache:
            self.attention_bias_cache = {}
        return self

    def get_attention_biases(self, device):
        if torch.jit.is_tracing() or self.training:
            return self.attention_biases[self.idxs]
        key = str(device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.attention_biases[self.idxs]
        return self.attention_bias_cache[key]

    def forward(self, x):
        if self.shape_branch and x.shape[-1] <= 4:
            return x
        return self.fc(x) + self.get_attention_biases(x.device)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_capture_per_device_cache_twice_with_examples_then_eager_fills_it(frontend):
    """Captured twice (example_inputs=): no traced value is left in the cache; pm and eager agree, before and after eager fills it."""
    torch.manual_seed(0)
    model, x = nn.Sequential(CachedBias(frontend == "export"), CachedBias(frontend == "export")).eval(), torch.randn(4, 8)
    first = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    assert model[0].attention_bias_cache == {}
    second = dpcompile.transform(model, ["cpu"] * 2, frontend=frontend, example_inputs=(x,))
    for pm in (first, second, first):
        torch.testing.assert_close(pm(x), model(x))  # eager fills the cache on its first call
    assert type(model[0].attention_bias_cache["cpu"]) is torch.Tensor


class ShiftedDecoder(nn.Module):
    """T5-style: decoder inputs made from ``labels`` by ``shift_tokens_right`` (new_zeros, then slice assignment)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids, labels):
        decoder_input_ids = labels.new_zeros(labels.shape)
        decoder_input_ids[..., 1:] = labels[..., :-1].clone()
        decoder_input_ids[..., 0] = 0
        decoder_input_ids.masked_fill_(decoder_input_ids == -100, 0)
        return self.head(self.embed(input_ids).mean(1, keepdim=True) + self.embed(decoder_input_ids))


def test_export_labels_only_t5_style_shift_tokens_right_matches_eager():
    """A T5-style model called with labels= only (decoder inputs derived from them) gives eager's logits."""
    torch.manual_seed(0)
    model = ShiftedDecoder()
    ids, labels = _ids(4, 12), _ids(4, 6)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_kwargs={"input_ids": ids, "labels": labels})
    torch.testing.assert_close(pm(input_ids=ids, labels=labels), model(ids, labels))


@pytest.mark.slow
def test_export_guard_bert_shorter_sequence_and_changed_scaling_are_refused():
    """A transformers BERT captured with 8 tokens: 1 token is refused (never (4, 8, 32)); dynamic_dims=[1] serves it;
    ``encoder.layer.1.attention.self.scaling`` changed (read behind a decorator and in eager_attention_forward) is refused."""
    from tests.thirdparty import import_or_skip

    transformers = import_or_skip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=50,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids, mask = _ids(4, 8), torch.ones(4, 8, dtype=torch.long)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_kwargs={"input_ids": ids, "attention_mask": mask})
    with pytest.raises(dpcompile.DpCompileError, match=r"'input_ids' has shape \(4, 1\).*\(\*, 8\)"):
        pm(input_ids=ids[:, :1], attention_mask=mask[:, :1])
    dynamic = dpcompile.transform(model, ["cpu"] * 2, example_kwargs={"input_ids": ids, "attention_mask": mask}, dynamic_dims=[1])
    out = dynamic(input_ids=ids[:, :1], attention_mask=mask[:, :1]).last_hidden_state
    torch.testing.assert_close(out, model(input_ids=ids[:, :1], attention_mask=mask[:, :1]).last_hidden_state)
    model.encoder.layer[1].attention.self.scaling = 0.5
    with pytest.raises(dpcompile.DpCompileError, match="'encoder.layer.1.attention.self.scaling'"):
        pm(input_ids=ids, attention_mask=mask)
