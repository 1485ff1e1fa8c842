"""The torch.export frontend on small models: the program it makes and how it runs."""

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.analysis.batch_dims import infer_input_dims, propagate
from dpcompile.analysis.placement import Split, Whole
from dpcompile.capture import capture_model
from dpcompile.fx_utils import propagate_shapes
from dpcompile.runtime.tensor_parallel import unshard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        if x.shape[-1] != 8:  # a shape branch: fx cannot trace it, export can
            x = x[..., :8]
        return self.norm(self.q_proj(x)).relu()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x, labels=None, scale: float = 1.0):
        for layer in self.layer:
            x = layer(x)
        logits = self.head(x.mean(1)) * scale
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels, ignore_index=-1), logits


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.dtype != torch.float32:  # a dtype branch
            x = x.float()
        y = self.drop(self.bn(self.conv(x)).relu())
        return self.fc(y.mean((2, 3)))


def _examples(batch=4):
    labels = torch.randint(0, 3, (batch,))
    labels[0] = -1  # ignored
    return torch.randn(batch, 5, 8), labels


def test_export_frontend_auto_falls_back_where_fx_fails():
    """frontend='auto' uses export for a shape branch when examples are given; 'fx' raises."""
    x, labels = _examples()
    gm, info = capture_model(Encoder(), frontend="auto", example_inputs=(x,), example_kwargs={"labels": labels})
    assert info.frontend == "export" and "branches on a shape" in info.fx_error
    with pytest.raises(dpcompile.TraceError, match="branches on a shape"):
        dpcompile.transform(Encoder(), ["cpu"] * 2, frontend="fx", example_inputs=(x,))


def test_export_frontend_forced_on_traceable_model():
    """frontend='export' exports even a model fx traces."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    _, info = capture_model(model, frontend="export", example_inputs=(torch.randn(3, 4),))
    assert info.frontend == "export"
    _, info = capture_model(model, frontend="auto", example_inputs=(torch.randn(3, 4),))
    assert info.frontend == "fx"


def test_export_frontend_needs_examples():
    """Without examples, the export frontend says what to pass."""
    with pytest.raises(dpcompile.TraceError, match="example_inputs="):
        capture_model(Encoder(), frontend="export")


class MaskBuiltOutsideExport(nn.Module):
    """Switch Transformers' stack: an ``attention_mask`` left None is built only outside torch.export."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None and not torch.compiler.is_compiling():
            attention_mask = torch.ones(input_ids.shape)
        return self.head(self.embed(input_ids) * attention_mask[:, :, None])


def test_export_frontend_names_the_argument_a_failing_line_finds_none():
    """Export failing on an argument left None (Switch Transformers' attention mask) said to check the examples
    and to transform a part of the model: it names the argument to pass, and a program given it runs as eager."""
    ids = torch.randint(0, 10, (4, 5))
    with pytest.raises(dpcompile.TraceError) as refused:
        dpcompile.transform(MaskBuiltOutsideExport(), ["cpu"] * 2, frontend="export", example_kwargs={"input_ids": ids})
    assert "'attention_mask' is None there" in str(refused.value) and "pass attention_mask= in example_kwargs=" in str(refused.value)
    assert "a route that works" not in str(refused.value)
    model, mask = MaskBuiltOutsideExport(), torch.ones(4, 5)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_kwargs={"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(pm(input_ids=ids, attention_mask=mask), model(ids, mask))


class ReturnsItsCache(nn.Module):
    """A multimodal transformers model whose language model's config turns the key/value cache on (Llava's)."""

    def __init__(self, transformers):
        super().__init__()
        self.config = transformers.LlavaConfig()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x), transformers_cache()


def transformers_cache():
    from transformers import DynamicCache

    return DynamicCache()


def test_export_frontend_names_the_config_that_turns_a_returned_cache_off():
    """A model returning a transformers cache (Llava: ``use_cache`` on its ``text_config``, out of reach of
    forward's arguments) was told to check its examples and transform a part: the error names the setting."""
    from tests.thirdparty import import_or_skip

    model = ReturnsItsCache(import_or_skip("transformers"))
    with pytest.raises(dpcompile.TraceError) as refused:
        dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(4, 4),))
    assert "turn it off with model.config.text_config.use_cache = False" in str(refused.value), refused.value
    assert "a route that works" not in str(refused.value)


class RouterConvertedInForward(nn.Module):
    """Switch Transformers' router: its classifier converted to the router's dtype at every call."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.classifier, self.head, self.dtype = nn.Linear(4, 4), nn.Linear(4, 2), dtype

    def forward(self, x):
        self.classifier = self.classifier.to(self.dtype)
        return self.head(torch.softmax(self.classifier(x), -1) * x)


def test_export_frontend_captures_a_module_to_that_changes_nothing():
    """``self.classifier.to(dtype)`` in forward, a no-op in eager, could not run on export's fake parameters
    ("Couldn't swap Linear.weight"): it is a no-op there too, and the program equals eager; a conversion that
    would change the weights is still refused, and ``nn.Module.to`` is torch's own again after transform."""
    torch.manual_seed(0)
    model, x = RouterConvertedInForward(), torch.randn(6, 4)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), eager(x))
    assert dpcompile.explain(pm, x).split_flop_fraction == 1.0
    with pytest.raises(dpcompile.TraceError, match="classifier.to"):
        dpcompile.transform(RouterConvertedInForward(torch.float64), ["cpu"] * 2, frontend="export", example_inputs=(x,))
    assert nn.Module.to.__qualname__ == "Module.to"


def test_export_frontend_program_reads_the_models_own_parameters():
    """get_attr targets are the model's paths, holding the model's Parameter objects; module calls restored."""
    model = Encoder()
    x, labels = _examples()
    gm, _ = capture_model(model, frontend="export", example_inputs=(x, labels))
    assert list(gm.state_dict()) == list(model.state_dict())
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == ["layer.0.q_proj", "layer.0.norm", "layer.1.q_proj", "layer.1.norm", "head"]


def test_export_frontend_names_nodes_after_module_paths_and_keeps_stack_traces():
    """Nodes read 'layer_0_q_proj', not 'linear_17', and point at the user's source."""
    x, labels = _examples()
    gm, _ = capture_model(Encoder(), frontend="export", example_inputs=(x, labels))
    names = {n.name for n in gm.graph.nodes}
    assert {"layer_0_q_proj", "layer_1_norm", "head"} <= names
    assert not any(name.startswith("linear") for name in names)
    q = next(n for n in gm.graph.nodes if n.name == "layer_0_q_proj")
    assert "test_export_frontend.py" in q.meta["stack_trace"]


def test_export_frontend_data_parallel_splits_everything_but_the_loss_combine():
    """With the ATen rules nothing runs whole except combining the loss's partial sums."""
    x, labels = _examples()
    gm, info = capture_model(Encoder(), frontend="export", example_inputs=(x, labels))
    propagate_shapes(gm, info.example_inputs)
    placements = propagate(gm, infer_input_dims(gm, example_inputs=info.example_inputs))
    whole = [n.name for n, p in placements.items() if isinstance(p, Whole) and n.op == "call_function"]
    assert whole == ["truediv"]
    assert isinstance(placements[next(n for n in gm.graph.nodes if n.name == "layer_1_q_proj")], Split)


def test_export_frontend_data_parallel_kwargs_other_batch_sizes_and_mean_loss_match_eager():
    """example_kwargs= works, the pm takes the same kwargs, other batch sizes run, the mean loss (ignore_index) is exact."""
    model = Encoder()
    reference = copy.deepcopy(model)
    x, labels = _examples()
    pm = dpcompile.transform(model, ["cpu"] * 4, example_inputs=(x,), example_kwargs={"labels": labels})
    for batch in (7, 3, 9):
        x, labels = _examples(batch)
        loss, logits = pm(x, labels=labels)
        want_loss, want_logits = reference(x, labels=labels)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(loss, want_loss)
        loss.backward()
        want_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")


Scores = collections.namedtuple("Scores", "logits total")


class NamedOutputs(nn.Module):
    """Returns a user namedtuple and a ``torch.return_types`` value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return Scores(y, y.sum()), y.min(dim=1)


def test_export_frontend_rebuilds_namedtuple_and_torch_return_types_outputs():
    """The program returns forward's own ``Scores`` and ``torch.return_types.min`` (they were
    refused: "cannot rebuild an output of type namedtuple"), gathered equal to eager."""
    model = NamedOutputs()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(x,), frontend="export")
    (scores, smallest), (want, want_min) = pm(x), reference(x)
    assert type(scores) is Scores and type(smallest) is torch.return_types.min
    torch.testing.assert_close(scores.logits, want.logits)
    torch.testing.assert_close(scores.total, want.total)
    assert torch.equal(smallest.indices, want_min.indices)


def test_export_frontend_checks_python_arguments_it_was_exported_for():
    """A Python argument baked in (scale=1.0) is checked at each call."""
    model = Encoder()
    x, labels = _examples()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, labels, 1.0))
    pm(x, labels, 1.0)
    with pytest.raises(dpcompile.DpCompileError, match="scale=2.0"):
        pm(x, labels, 2.0)


def test_export_frontend_batch_norm_and_dropout_follow_the_mode():
    """Batch norm (whole-batch statistics, running stats updated once) and dropout follow pm.train()/eval()."""
    model = ConvBN()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 3, 6, 6),))
    assert {n.target for n in pm.graph.nodes if n.op in ("call_module", "call_method")} >= {"conv", "fc"}
    model.drop.p = reference.drop.p = 0.0  # the module's own p is read at run time
    x = torch.randn(7, 3, 6, 6)
    pm.train()
    reference.train()
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)
    assert model.bn.num_batches_tracked.item() == reference.bn.num_batches_tracked.item() == 1
    pm.eval()
    reference.eval()
    torch.testing.assert_close(pm(x), reference(x), atol=1e-5, rtol=1e-5)


def test_export_frontend_batch_norm_with_a_cumulative_average_counts_once():
    """``momentum=None``: export computes the factor from the count it bumps (``1 / count.item()``);
    the restored module call counts and averages itself, as eager does, over several steps."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(6, 4, dtype=torch.float64),))
    for _ in range(3):
        x = torch.randn(6, 4, dtype=torch.float64)
        torch.testing.assert_close(pm(x), reference(x))
    torch.testing.assert_close(pm.state_dict(), reference.state_dict())
    assert int(model[1].num_batches_tracked) == 3


def test_export_frontend_tensor_parallel_shards_restored_linears():
    """Tensor parallel finds the Linear layers through the restored module calls and matches eager."""
    model = Encoder()
    x, labels = _examples()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, frontend="export", example_inputs=(x, labels))
    assert any(style != "replicate" for style in pm.plan.values())
    loss, logits = pm(x, labels)
    want_loss, want_logits = model(x, labels)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)


class TransposedLinear(nn.Linear):
    """Falcon's ``FalconLinear``: ``x @ self.weight.T`` (+ bias), which export records as matmul."""

    def forward(self, x):
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return (x @ self.weight.T) * 2.0  # more than a Linear: stays ops


class TransposedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = TransposedLinear(8, 16, bias=False), TransposedLinear(16, 8)
        self.other = ScaledLinear(8, 8)

    def forward(self, x):
        return self.other(self.down(torch.relu(self.up(x))))


def test_export_frontend_tensor_parallel_shards_a_linear_written_as_a_transposed_matmul():
    """A Linear subclass computing ``x @ W.T (+ b)`` is called as the module, so it is sharded (Falcon's
    layers were all 'replicate'); one that computes more stays as its ops."""
    model = TransposedMLP().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, frontend="export", example_inputs=(x,))
    assert pm.plan == {"up": "column", "down": "row", "other": "replicate"}
    torch.testing.assert_close(pm(x), reference(x))
    pm(x).sum().backward()
    reference(x).sum().backward()
    grads = {key: unshard([pm.get_parameter(n).grad for n in names], spec, "cpu")
             for key, (spec, names) in pm.param_shards.items()}  # fmt: skip
    for name, p in reference.named_parameters():
        got = grads[name] if name in grads else pm.get_parameter(name).grad
        torch.testing.assert_close(got, p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_export_frontend_program_survives_dpcompile_export_and_load(tmp_path):
    """An exported program's ATen targets serialise by name: dpcompile.export / load give the same outputs."""
    model = Encoder()
    x, labels = _examples()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, labels))
    dpcompile.export(pm, tmp_path / "program")
    loaded = dpcompile.load(tmp_path / "program")
    x, labels = _examples(6)
    for got, want in zip(loaded(x, labels), model(x, labels)):
        torch.testing.assert_close(got, want)


def test_export_frontend_explain_and_verify():
    """explain reports the exported program; verify finds it equal to the model."""
    model = Encoder()
    x, labels = _examples()
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x, labels))
    assert "data_parallel" in str(dpcompile.explain(pm, x, labels))
    assert dpcompile.verify(pm, model, x, labels)


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(6, 4)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        return x + self.pos(positions).to(x.dtype)


def test_export_frontend_reads_devices_from_inputs_not_the_export_device():
    """Export bakes its device into factories; the program reads it from its input instead."""
    gm, _ = capture_model(Positions(), frontend="export", example_inputs=(torch.randn(3, 6, 4),))
    baked = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device)]
    assert not baked
    assert "x_device = x.device" in gm.code


class Attention(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.p = p

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * (2.0 if self.training else 1.0)


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if self.training:
            x = x + torch.randn_like(x)
        return self.fc(x)


def test_export_frontend_serves_both_modes_where_only_constants_differ():
    """Attention's dropout_p (0.1 in training, 0 in eval) is chosen at run time: one program, both modes."""
    model = Attention().eval()
    x = torch.randn(4, 5, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    assert "mode_value" in pm.program_for_call(x).code  # the training mode, captured at its first call
    assert pm(x).shape == x.shape  # runs (with dropout) instead of refusing
    pm.eval()
    torch.testing.assert_close(pm(x), model(x))


def test_export_frontend_exports_the_other_mode_at_its_first_call(monkeypatch):
    """Transform exports only the mode the model is in; the first call in the other mode exports it,
    and gives eager's numbers there."""
    import torch.export

    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = Scaled().eval()
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x), model(x))
    assert len(calls) == 1
    pm.train()
    model.train()
    torch.testing.assert_close(pm(x), model(x))
    assert len(calls) > 1
    exports = len(calls)
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    pm(x)
    assert len(calls) == exports  # captured once


def test_export_frontend_checks_the_mode_where_forward_branches_on_it():
    """`if self.training:` around ops is baked in by export: a call in the other mode raises, never runs the wrong program."""
    model = Noisy().eval()
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    with pytest.raises(dpcompile.DpCompileError, match="exported in eval mode"):
        pm(x)


class KeywordFlags(nn.Module):
    """transformers 5's forward: ``use_cache`` named, ``return_dict=`` and the other flags through ``**kwargs``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, use_cache=None, **kwargs):
        return self.fc(x)


@pytest.mark.parametrize(("flags", "match"), [
    ({"use_cache": True}, r"use_cache=True makes KeywordFlags.forward return a key/value cache.*pass use_cache=False"),
    ({"return_dict": False}, r"\['return_dict'\] through KeywordFlags.forward's \*\*kwargs.*leave it out.*model.config.return_dict = False"),
])  # fmt: skip
def test_flags_export_cannot_take_are_refused_with_the_way_out(flags, match):
    """A Python flag through ``**kwargs`` (once told to "name it in forward", inside transformers) and
    ``use_cache=True`` (once torch's "DynamicCache ... not a known type") say what to do instead."""
    with pytest.raises(dpcompile.TraceError, match=match):
        dpcompile.transform(KeywordFlags(), ["cpu"] * 2, example_kwargs={"x": torch.randn(4, 4), **flags}, frontend="export")


class InPlaceUnsqueezedMask(nn.Module):
    """BigBird's block-sparse mask: ``einsum(...)`` then ``unsqueeze_(1)``, an in-place view."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, mask):
        band = torch.einsum("blq,blk->blqk", mask[:, 1:3], mask[:, :2])
        band.unsqueeze_(1)
        return self.fc(x).view(x.shape[0], 4, 2, 3, 3) + (1.0 - band) * -100.0


def test_export_in_place_view_of_a_per_sample_value_splits_on_the_batch():
    """An uneven batch of 5 on 3 devices: the in-place ``unsqueeze_`` keeps the batch at dim 0 (it was gathered
    along dim 1 and failed inside the program)."""
    torch.manual_seed(0)
    model = InPlaceUnsqueezedMask()
    x, mask = torch.randn(5, 12, 6), torch.ones(5, 4, 3)
    mask[1, 2:] = 0
    pm = dpcompile.transform(model, ["cpu"] * 3, frontend="export", example_inputs=(x, mask))
    torch.testing.assert_close(pm(x, mask), model(x, mask))


class ModeInAHelper(nn.Module):
    """Reads ``self.training`` in a method forward calls, not in forward (BigBird's random blocks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def _scale(self):
        return 2.0 if self.training else 1.0

    def forward(self, x):
        return self.fc(x) * self._scale()


def test_export_mode_read_in_a_helper_method_serves_the_other_mode():
    """Transformed in eval, called in train: eager's train value (the eval program ran before)."""
    torch.manual_seed(0)
    model, x = ModeInAHelper().eval(), torch.randn(4, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    model.train()
    torch.testing.assert_close(pm(x), model(x))


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x, mask=None):
        return self.fc(x) * mask


def _scale_input(module, args):
    assert args[0].dim() == 2, "a batch of rows"
    return args[0] * 2


def _scale_mask(module, args, kwargs):
    return (args[0] + 1,), {**kwargs, "mask": kwargs["mask"] * 3}


@pytest.mark.parametrize("with_kwargs", [False, True])
def test_root_pre_hook_reads_its_positional_argument(with_kwargs):
    """Export passes every argument by name, so a root pre-hook's ``args[0]`` was out of range
    (a TraceError). It sees the positional examples as eager's call does; what it returns runs
    in the program, data and tensor parallel, and its hook is left registered as it was."""
    x, mask = torch.randn(4, 8, dtype=torch.float64), torch.rand(4, 4, dtype=torch.float64)
    for tensor_parallel in (False, True):
        torch.manual_seed(0)
        model = _Masked()
        if with_kwargs:
            model.register_forward_pre_hook(_scale_mask, with_kwargs=True)
        else:
            model.register_forward_pre_hook(_scale_input)
        hooks, eager = dict(model._forward_pre_hooks), copy.deepcopy(model)
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", tensor_parallel=tensor_parallel,
                                 example_inputs=(x,), example_kwargs={"mask": mask})  # fmt: skip
        assert model._forward_pre_hooks == hooks and bool(model._forward_pre_hooks_with_kwargs) == with_kwargs
        torch.testing.assert_close(pm(x + 1, mask=mask), eager(x + 1, mask=mask))


def test_transformer_encoder_zeroes_padding_where_eager_takes_its_nested_path():
    """Eager's TransformerEncoder (batch first, enable_nested_tensor) in eval without gradients runs
    a nested tensor and returns zeros at the padded positions; export captured the slow path, which
    computes them (all 96 padded values wrong). The program makes eager's choice at each call: the
    whole batch's padding at the end of every row (a split batch, one shard left-aligned, the other
    not: no zeros), gradients off, eval."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    norm = nn.LayerNorm(16, dtype=torch.float64)
    nn.init.normal_(norm.bias)  # eager pads, then norms: a padded row is the bias (a fresh norm's is zero)
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    left = torch.zeros(4, 5, dtype=torch.bool)
    left[0, 3:] = left[2, 1:] = True
    mixed = left.clone()
    mixed[3, 0] = True
    for final_norm in (None, norm):
        model = nn.TransformerEncoder(copy.deepcopy(layer), 1, norm=copy.deepcopy(final_norm)).eval()
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,),
                                 example_kwargs={"src_key_padding_mask": left})  # fmt: skip
        padded_row = torch.zeros(16, dtype=torch.float64) if final_norm is None else norm.bias
        for mask, grad in [(left, False), (mixed, False), (left, True)]:
            with torch.set_grad_enabled(grad):
                want = eager(x, src_key_padding_mask=mask)
                torch.testing.assert_close(pm(x, src_key_padding_mask=mask), want)
            assert bool((want == padded_row).all(-1).any()) == (mask is left and not grad)


@pytest.mark.parametrize("dropout, layout", [(nn.Dropout2d, {}), (nn.AlphaDropout, {}), (nn.Dropout2d, {"pipeline": 2})])
def test_feature_and_alpha_dropout_follow_the_mode(dropout, layout):
    """Export writes Dropout1d/2d/3d as ``feature_dropout(x, p, train)`` and AlphaDropout as
    ``alpha_dropout``, with the mode baked in: only ``dropout`` was known to bake it, so a program
    transformed in training kept dropping in eval (and one transformed in eval never dropped). The
    op reads its module's mode at run time, in a pipeline's stages too."""
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    for start, other in (("train", "eval"), ("eval", "train")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 1), dropout(0.5), nn.Conv2d(4, 2, 1)).double()
        getattr(model, start)()
        eager = copy.deepcopy(model)
        pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,), **layout)
        _assert_draws_as_eager_in_each_mode(pm, eager, x, (start, other), f"transformed in {start}, ")


def _assert_draws_as_eager_in_each_mode(pm, eager, x, modes, label=""):
    """In each of ``modes`` in turn, the program's output from seed 1 equals eager's from the same seed."""
    for mode in modes:
        getattr(pm, mode)(), getattr(eager, mode)()
        torch.manual_seed(1)
        got = pm(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, eager(x), msg=lambda m, mode=mode: f"{label}run in {mode}: {m}")


class _MonteCarloDropout2d(nn.Module):
    def forward(self, x):
        return F.dropout2d(x, 0.5, training=True)  # drops in eval too: the user's constant, not the mode


def test_a_functional_feature_dropout_keeps_its_constant_training_argument():
    """``F.dropout2d(x, training=True)`` in a module's forward (Monte Carlo dropout) drops in eval as in
    eager: only the dropout modules' own op reads their mode at run time (a functional call's constant
    was rewritten to its module's mode: the program stopped dropping in eval)."""
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _MonteCarloDropout2d()).double()
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    _assert_draws_as_eager_in_each_mode(pm, eager, x, ("train", "eval"))


def _leaky_by_mode(module, h):
    return F.rrelu(h, training=module.training)


def _halved_when_learning(module, h):
    if module.training:
        h = h * 0.5
    return h


class ModeInAFunction(nn.Module):
    """Reads its mode only in a helper outside the class (``helper(self, h)``)."""

    helper = staticmethod(_halved_when_learning)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x):
        return self.helper(self, self.fc(x))


class SlopesByMode(ModeInAFunction):
    """Export bakes the mode into ``rrelu_with_noise``."""

    helper = staticmethod(_leaky_by_mode)


def test_an_op_given_the_mode_as_an_argument_follows_the_mode():
    """An op taking ``training=`` as a constant (rrelu's random slopes in training, fixed ones in eval) was
    not known to bake the mode: transformed in training, the program drew slopes in eval (off by 0.09)."""
    torch.manual_seed(0)
    model, x = SlopesByMode(), torch.randn(4, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    pm.eval(), eager.eval()
    torch.testing.assert_close(pm(x), eager(x))


def test_a_mode_read_in_a_helper_outside_the_class_is_checked():
    """A helper function reads the module's mode (``if module.training:``), which no source of the model's
    classes shows: the program exported in training ran its branch in eval too (half eager's output,
    silently). The read is seen while exporting: the other mode is refused by name, as for forward's own."""
    torch.manual_seed(0)
    model, x = ModeInAFunction(), torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.eval()
    with pytest.raises(dpcompile.DpCompileError, match="exported in training mode"):
        pm(x)
    assert "training" not in nn.Module.__dict__


class ModeInAFunctionPastABranch(ModeInAFunction):
    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent: the first export stops here, the one deciding on the examples goes on
            h = h + 1
        return _halved_when_learning(self, h)


def test_a_mode_read_in_a_helper_past_a_data_branch_is_checked():
    """The helper's read comes after a branch on the data, which the first export stops at: the export that
    decides on the examples records it too (it was missed, and eval ran the training branch silently)."""
    torch.manual_seed(0)
    model, x = ModeInAFunctionPastABranch(), torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    pm.eval()
    with pytest.raises(dpcompile.DpCompileError, match="exported in training mode"):
        pm(x)
