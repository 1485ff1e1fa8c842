"""``activation_checkpointing=``: regions recomputed in backward, on every layout in one process.

Loss and every gradient equal eager's (float64) with data, tensor and pipeline parallelism and the
export frontend; dropout draws what the program without checkpointing draws from the same seed;
and the recompute really happens: fewer bytes saved for backward, each region's forward run again.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.errors import DpCompileError
from tests.helpers import full_gradients
from tests.thirdparty import models


class Counted(nn.Module):
    """A ReLU kept as one call (a leaf) that counts how often it runs."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return torch.relu(x)


dpcompile.register_batch_rule(Counted, "elementwise")


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0):
        super().__init__()
        self.fc1, self.act, self.fc2, self.drop = nn.Linear(d, 4 * d), Counted(), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.act(self.fc1(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 8, n: int = 4, p: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, p) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


class ConvNet(nn.Module):
    """A small CNN without BatchNorm: repeated conv blocks, pooled, a linear head."""

    def __init__(self, c: int = 4, n: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GELU()) for _ in range(n)])
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


LAYOUTS = {
    "data_parallel": {},
    "tensor_parallel": {"tensor_parallel": True},
    "pipeline": {"pipeline": 2, "micro_batches": 2},
}


def _saved_bytes(run) -> int:
    """Bytes autograd saves for backward while ``run()`` runs (outside checkpointed regions)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return total, out


def _grads(model, pm, sharded):
    return full_gradients(pm) if sharded else {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_checkpointing_mlp_stack_equals_eager(layout):
    """Loss and every gradient equal eager's (float64) with every block recomputed."""
    reference = Stack().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True, **LAYOUTS[layout])
    assert "dpcompile_runtime_checkpoint(layers_0" in pm.code
    x = torch.randn(6, 8, dtype=torch.float64)
    loss = pm(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    got = _grads(model, pm, layout == "tensor_parallel")
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_checkpointing_recomputes_in_backward(layout):
    """Each checkpointed block's forward runs again in backward, and fewer bytes are saved."""
    x = torch.randn(6, 8)
    plain = dpcompile.transform(Stack(), ["cpu"] * 2, leaf_modules=[Counted], **LAYOUTS[layout])
    checkpointed = dpcompile.transform(Stack(), ["cpu"] * 2, activation_checkpointing=["layers.1", "layers.2"],
                                       leaf_modules=[Counted], **LAYOUTS[layout])  # fmt: skip
    saved_plain, loss_plain = _saved_bytes(lambda: plain(x))
    saved_checkpointed, loss = _saved_bytes(lambda: checkpointed(x))
    assert saved_checkpointed < saved_plain
    Counted.calls = 0
    loss_plain.backward()
    assert Counted.calls == 0
    loss.backward()
    replicas = {"data_parallel": 2, "tensor_parallel": 1, "pipeline": 2}[layout]  # replicas / micro-batches
    assert Counted.calls == 2 * replicas  # layers.1 and layers.2, once per replica, again


@pytest.mark.parametrize("layout", ["data_parallel", "pipeline"])
def test_activation_checkpointing_dropout_draws_as_without(layout):
    """With dropout on and the same seed, outputs and gradients equal the program without
    checkpointing: the recompute restores the RNG state and draws the same masks."""
    reference = Stack(p=0.3).double()
    model = copy.deepcopy(reference)
    plain = dpcompile.transform(reference, ["cpu"] * 2, **LAYOUTS[layout])
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True, **LAYOUTS[layout])
    x = torch.randn(6, 8, dtype=torch.float64)
    torch.manual_seed(7)
    expected = plain(x)
    expected.backward()
    torch.manual_seed(7)
    loss = pm(x)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_activation_checkpointing_cnn_equals_eager():
    """A BN-free CNN: its repeated conv blocks recomputed, data parallel, gradients as eager."""
    reference = ConvNet().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True)
    assert pm.code.count("dpcompile_runtime_checkpoint(") == 6  # 3 blocks x 2 replicas
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    out = pm(x)
    out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_activation_checkpointing_export_frontend_equals_eager():
    """Under the export frontend the same regions are found (module paths from the export's
    module stack) and gradients equal eager's."""
    reference = Stack().double()
    model = copy.deepcopy(reference)
    x = torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,),
                             activation_checkpointing=["layers.0", "layers.3"])  # fmt: skip
    assert pm.code.count("dpcompile_runtime_checkpoint(") == 4
    pm(x).backward()
    reference(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_activation_checkpointing_any_submodule_granularity():
    """A path below a block (``layers.0.fc2``) is a region of its own."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, activation_checkpointing=["layers.0.fc2"])
    assert "layers_0_fc2_dev0 = dpcompile_runtime_checkpoint(layers_0_fc2_dev0_region" in pm.code
    assert pm.strategies["activation_checkpointing"] == "recompute in backward: layers.0.fc2"


def test_activation_checkpointing_a_module_called_twice_beside_the_modules_between_equals_eager():
    """``shared`` called before and after ``a`` and ``b``, all three named: a region per call of each
    (was a PassError: the two calls' region took in ``a`` and ``b``); gradients as eager's."""
    from tests.passes.test_checkpoint_activations import Twice

    reference = Twice().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=["shared", "a", "b"])
    assert pm.code.count("dpcompile_runtime_checkpoint(shared_dev") == 4
    x = torch.randn(6, 4, dtype=torch.float64)
    pm(x).backward()
    reference(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale):
        return x + torch.tanh(self.fc(x)) * scale.unsqueeze(0)  # Llama's cos.unsqueeze(1): no batch


class SharedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock() for _ in range(2))
        self.register_buffer("base", torch.randn(8))

    def forward(self, x):
        scale = self.base * 2
        for layer in self.layers:
            x = layer(x, scale)
        return x.pow(2).mean()


def test_activation_checkpointing_a_block_reading_a_value_every_micro_batch_shares_runs_1f1b():
    """A block that reshapes a value no micro-batch owns (rotary positions) is a region per micro-batch,
    the shared value made once before them (one region took every micro-batch: 1F1B refused it)."""
    torch.manual_seed(0)
    reference = SharedScale().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b", activation_checkpointing=True)
    assert "layers_0_mb1 = dpcompile_runtime_checkpoint(layers_0_mb1_region" in pm.code
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(pm(x), reference(x))
    reference(x).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class CheckedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        torch._assert(x.dim() == 2, "expected (batch, features)")  # torchvision ViT's EncoderBlock check
        return x + torch.tanh(self.fc(x))


class CheckedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(CheckedBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def test_activation_checkpointing_a_block_whose_output_is_gathered_for_a_check_is_a_region_per_micro_batch():
    """The next block's ``x.dim()`` reads the micro-batches' outputs gathered (made under the block's
    path): the gather is left after the regions, each micro-batch its own region (one region took
    both micro-batches of layers.0, recomputing both at once); loss and gradients equal eager's."""
    torch.manual_seed(0)
    reference = CheckedStack().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, activation_checkpointing=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = pm(x)
    regions = set(re.findall(r"= dpcompile_runtime_checkpoint\((\w+)_region", pm.code))
    assert regions == {f"layers_{i}_mb{m}" for i in range(2) for m in range(2)}
    loss.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_activation_checkpointing_torchvision_vit_under_gpipe_is_a_region_per_block_and_micro_batch():
    """torchvision's ViT checks each EncoderBlock's ``input.dim()``, which reads the previous block's
    micro-batches gathered: each block is still a region per micro-batch; output and gradients equal eager's."""
    reference, (x,) = models()["tv_vit"]()
    reference, x = reference.double(), x.double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, activation_checkpointing=True)
    out = pm(x)
    regions = set(re.findall(r"= dpcompile_runtime_checkpoint\((\w+)_region", pm.code))
    assert regions == {f"encoder_layers_encoder_layer_{i}_mb{m}" for i in range(2) for m in range(2)}
    out.pow(2).mean().backward()
    expected = reference(x)
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class PositionBiasBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.position_bias = nn.Linear(8, 8), nn.Embedding(4, 8)

    def forward(self, x):
        bias = self.position_bias(torch.arange(4)).sum(0)  # T5's relative_attention_bias: an Embedding, no batch
        return x + torch.tanh(self.fc(x)) * bias


class PositionBiasStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(PositionBiasBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def test_activation_checkpointing_a_block_embedding_positions_no_micro_batch_owns_runs_1f1b():
    """An Embedding of positions inside a block (T5's position bias) is made once before the
    regions, each micro-batch its own region (one region took both: 1F1B refused it at layers_0);
    loss and gradients, the Embedding's included, equal eager's."""
    torch.manual_seed(0)
    reference = PositionBiasStack().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b", activation_checkpointing=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = pm(x)  # a training call runs forward and backward
    regions = set(re.findall(r"= dpcompile_runtime_checkpoint\((\w+)_region", pm.code))
    assert regions == {f"layers_{i}_mb{m}" for i in range(2) for m in range(2)}
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_activation_checkpointing_unknown_path_names_the_nearest():
    """A path that is not a module is refused, naming the nearest ones, before anything is built."""
    with pytest.raises(ValueError, match=r"'layers\.9', which is not a module of Stack; nearest: \['layers\.3'"):
        dpcompile.transform(Stack(), ["cpu"] * 2, activation_checkpointing=["layers.9"])


class PlainStack(nn.Module):
    """Stack's blocks as attributes of their own, in no list."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.block0, self.block1, self.block2, self.head = Block(d), Block(d), Block(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.block2(self.block1(self.block0(x)))).pow(2).mean()


@pytest.mark.parametrize("layout", ["data_parallel", "tensor_parallel"])
def test_activation_checkpointing_true_finds_blocks_held_as_attributes(layout, monkeypatch):
    """Blocks of one type and shape held as plain attributes are the repeated blocks True recomputes
    (it was refused: "PlainStack has none"), and plan="auto" weighs recomputing them; loss and every
    gradient equal eager's."""
    torch.manual_seed(0)
    reference = PlainStack().double()
    model, x = copy.deepcopy(reference), torch.randn(6, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True, **LAYOUTS[layout])
    assert pm.strategies["activation_checkpointing"] == "recompute in backward: block0, block1, block2"
    loss, expected = pm(x), reference(x)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    got = _grads(model, pm, layout == "tensor_parallel")
    for name, q in reference.named_parameters():
        torch.testing.assert_close(got[name], q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    if layout == "data_parallel":
        from dpcompile.planner import plan_layouts

        monkeypatch.setenv("DPCOMPILE_CALIBRATION", "off")  # the reference constants: nothing timed or cached
        planned = plan_layouts(reference, ["cpu#0", "cpu#1"], {"cpu#0": 1 << 30, "cpu#1": 1 << 30}, optimizer=None,
                               training=True, example_inputs=(x,), example_kwargs=None, device=torch.device("cpu"))  # fmt: skip
        assert {"dp2", "dp2 +ckpt"} <= {c.spec.name for c in planned.candidates}


class _Conv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout)


class _Branches(nn.Module):
    """Inception's shape: four parallel 1x1 convolutions of one branch, beside a stem holding most weights."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 64, 5)
        self.a, self.b, self.c, self.d = (_Conv(64, 4) for _ in range(4))


def test_parallel_branches_holding_little_of_the_model_are_not_its_repeated_blocks():
    """Sibling blocks are the model's repeated blocks (for activation checkpointing and the planner's units)
    only where they hold at least half its parameters: a branch's parallel convolutions stayed units of
    their own (torchvision's Inception v3 would have had 4 of one branch's taken for its blocks)."""
    from dpcompile.analysis.checkpoint_regions import repeated_blocks

    assert repeated_blocks(_Branches()) == ()
    assert repeated_blocks(PlainStack()) == ("block0", "block1", "block2")


def test_activation_checkpointing_true_without_blocks_is_refused():
    """True on a model with no repeated blocks says to name the modules, with the model's own names."""
    with pytest.raises(DpCompileError, match=r"name the modules to recompute, e\.g\. activation_checkpointing=\['0', '1'\]"):
        dpcompile.transform(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ["cpu"] * 2, activation_checkpointing=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_checkpointing_explain_shows_regions_and_fewer_activations(layout):
    """explain lists the regions, and its estimate (the planner's) counts the activations held at each
    device's predicted peak with them recomputed: fewer than without (a batch where activations, not
    the weights, make the peak: at 16 rows the data-parallel peak measured the same with and without)."""
    x = torch.randn(256, 8)
    plain = dpcompile.explain(dpcompile.transform(Stack(), ["cpu"] * 2, **LAYOUTS[layout]), x)
    pm = dpcompile.transform(Stack(), ["cpu"] * 2, activation_checkpointing=True, **LAYOUTS[layout])
    report = dpcompile.explain(pm, x)
    assert set(report.checkpoint_regions.values()) == {f"layers.{i}" for i in range(4)}
    assert "Recomputed in backward (activation checkpointing)" in str(report)
    for device, kinds in report.memory_estimate.items():
        assert 0 < kinds["activations"] < plain.memory_estimate[device]["activations"]


def test_activation_checkpointing_auto_without_examples_is_refused_with_the_way_out():
    """"auto" predicts each choice's peak from a fake run: without examples, a ValueError saying to give them."""
    with pytest.raises(ValueError, match="give example_inputs="):
        dpcompile.transform(Stack(), ["cpu"] * 2, activation_checkpointing="auto", memory_per_device="1GiB")


def test_activation_checkpointing_regions_survive_a_model_change():
    """A submodule added to the model after transform (the program re-adopts the model's modules)
    leaves the regions in place; state_dict keeps the model's keys."""
    model = Stack()
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True)
    model.extra = nn.Identity()
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert list(pm.state_dict()) == list(model.state_dict())


def test_activation_checkpointing_one_f_one_b_recomputes_and_equals_eager():
    """schedule="1f1b": each micro-batch's blocks run again in its backward; gradients as eager's."""
    reference = Stack().double()
    model = copy.deepcopy(reference)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=2, schedule="1f1b",
                             activation_checkpointing=True, leaf_modules=[Counted])  # fmt: skip
    x = torch.randn(6, 8, dtype=torch.float64)
    Counted.calls = 0
    loss = pm(x)  # a training call runs forward and backward
    assert Counted.calls == 2 * 4 * 2  # 4 blocks x 2 micro-batches, forward and recompute
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class DashedBlocks(nn.Module):
    """Blocks named as torchvision's RegNet names them (``block1-0``): not Python identifiers."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential()
        for i in range(2):
            self.blocks.add_module(f"block1-{i}", nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_activation_checkpointing_in_a_pipeline_names_a_block_that_is_no_identifier():
    """A region's argument was named after the module path: ``def forward(self, blocks_block1-0_module)``
    was a SyntaxError (a PassError out of transform)."""
    torch.manual_seed(0)
    model = DashedBlocks()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, activation_checkpointing=True, example_inputs=(x,))
    out, expected = pm(x), eager(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_activation_checkpointing_a_batch_norm_region_pickles():
    """A region holding BatchNorm (its runtime branches on the module's mode) survives torch.save /
    torch.load: the copy's output, gradients and running statistics equal eager's. (fx pickled the
    region by tracing its code again, which entered that branch: a TraceError on load.)"""
    reference = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2, activation_checkpointing=["1"])
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(5, 4, dtype=torch.float64)
    out, expected = loaded(x), reference(x)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for (name, p), q in zip(loaded.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
    for (name, b), c in zip(loaded.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=lambda m, name=name: f"buffer {name}: {m}")


class LongNamedStack(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a_rather_long_list_of_residual_blocks = nn.ModuleList(Block(d) for _ in range(5))

    def forward(self, x):
        for block in self.a_rather_long_list_of_residual_blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_program_recomputing_many_blocks_exports_and_loads(tmp_path):
    """Its strategy names every recomputed block (here 240 characters): the folder export writes loads
    (it was refused at load: "strategies ... is not {dimension: words}", under 200 characters)."""
    torch.manual_seed(0)
    model, x = LongNamedStack().double(), torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, activation_checkpointing=True)
    assert len(pm.strategies["activation_checkpointing"]) > 200
    dpcompile.export(pm, tmp_path / "program")
    loaded = dpcompile.load(tmp_path / "program", trust_code=True)  # its regions are pickled: our own folder
    assert loaded.strategies == pm.strategies
    torch.testing.assert_close(loaded(x), model(x))
