"""Pipeline stages whose layers are tensor parallel, in one process: 4 virtual devices = 2 stages x 2
shards (stage i on devices[2i:2i+2]). Outputs, the mean loss and every gradient (the shards'
gradients gathered) equal the eager model's for 1, 2 and 4 micro-batches with an uneven last
micro-batch (a batch of 7), in float64; on 4 fake GPUs every value and shard sits on its stage's
device. GPT-2 through the export frontend: ``tests/integration/test_pipeline_transformers.py``
(it shares that file's exported program).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from dpcompile.errors import DpCompileError
from tests.helpers import full_gradients


class Stack(nn.Module):
    """Two MLP blocks (widen, narrow) and a head, with a classification loss (``labels=``)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)]
        )  # fmt: skip
        self.head = nn.Linear(width, 3)

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = self.head(x)
        return logits, F.cross_entropy(logits, labels)


def _inputs(batch: int = 7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g)


def _assert_gradients_equal(pm: nn.Module, reference: nn.Module) -> None:
    got = full_gradients(pm)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_pipeline_tensor_parallel_mlp_equals_eager(micro):
    """2 stages x 2 shards: logits, mean loss and every gradient as eager; Megatron pairs per stage."""
    reference = Stack().double()
    x, labels = _inputs()
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=2, tensor_parallel=True,
                             micro_batches=micro, example_inputs=(x, labels))  # fmt: skip
    assert [s.module_paths for s in pm.stages] == [("layers.0", "layers.1"), ("layers.2", "layers.3", "head")]
    assert (
        pm.plan["layers.0"] == pm.plan["layers.2"] == "column" and pm.plan["layers.1"] == pm.plan["layers.3"] == "row"
    )
    assert pm.stage_groups == [("cpu", "cpu"), ("cpu", "cpu")]
    logits, loss = pm(x, labels)
    want_logits, want_loss = reference(x, labels)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)
    loss.backward()
    want_loss.backward()
    _assert_gradients_equal(pm, reference)
    if micro > 1:  # each micro-batch's column -> row pair: one all-reduce, no gather between
        assert "layers_1_all_reduce_mb1 = dpcompile_runtime_tensor_parallel_reduce_to_device(" in pm.code
        assert "layers_2_mb1_dev1 = torch._C._nn.linear(tanh_1_copy_mb1_dev1" in pm.code


class TiedLM(nn.Module):
    """An embedding, an MLP, an LM head tied to the embedding (vocab-parallel) and a cross-entropy of
    the flattened logits: ``flatten(0, 1)`` has only a batch rule, which keeps the logits vocab-sharded."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        x = self.embed(ids)
        x = x + self.fc2(torch.tanh(self.fc1(x)))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_pipeline_tensor_parallel_1f1b_vocab_parallel_loss_of_a_tied_lm_equals_eager():
    """The loss stays vocab-parallel through the flatten (no logits gathered) and is a mean of each
    micro-batch's sum over its valid labels, so 1F1B backwards each micro-batch on its own: the loss
    and every gradient (the tied weight's too) as eager, with ignored labels."""
    torch.manual_seed(0)
    reference = TiedLM().double()
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 16, (5, 3), generator=g), torch.randint(0, 16, (5, 3), generator=g)
    labels[0, :2] = labels[3, 1] = -100
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=2, tensor_parallel=True,
                             micro_batches=2, schedule="1f1b", example_inputs=(ids, labels))  # fmt: skip
    assert pm.plan["head"] == "column" and pm.plan["embed"] == "vocab"
    assert "cross_entropy_sum_mb1 = dpcompile_runtime_tensor_parallel_cross_entropy_from_parts(" in pm.code
    assert "cross_entropy = dpcompile_runtime_mean_of_partials(" in pm.code
    assert pm.code.count("gather_to_device(") == 2  # each micro-batch's logsumexp (rows x shards), no logits
    loss = pm(ids, labels)
    expected = reference(ids, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    _assert_gradients_equal(pm, reference)


class BNStack(nn.Module):
    """A column -> row pair, BatchNorm, another pair; a sum loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.bn = nn.Linear(8, 16), nn.Linear(16, 8), nn.BatchNorm1d(8)
        self.fc3, self.fc4 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.bn(self.fc2(F.relu(self.fc1(x))))
        return self.fc4(F.relu(self.fc3(h))).sum()


@pytest.mark.parametrize(("micro", "batch"), [(1, 7), (4, 3)])
def test_pipeline_tensor_parallel_1f1b_equals_eager(micro, batch):
    """schedule='1f1b' with one micro-batch, and with a batch below micro_batches (a program built
    for the call): the call backwards the mean loss; logits, loss and every gradient as eager."""
    reference = Stack().double()
    x, labels = _inputs(batch)
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=2, tensor_parallel=True,
                             micro_batches=micro, schedule="1f1b", example_inputs=_inputs())  # fmt: skip
    logits, loss = pm(x, labels)
    expected_logits, expected = reference(x, labels)
    expected.backward()
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected)
    _assert_gradients_equal(pm, reference)


def test_pipeline_tensor_parallel_batchnorm_uses_whole_batch_statistics():
    """The micro-batches meet at BatchNorm (whole-batch statistics, running stats updated once)."""
    reference = BNStack().double()
    x, _ = _inputs()
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=2, tensor_parallel=True,
                             micro_batches=2, example_inputs=(x,))  # fmt: skip
    assert "dpcompile_runtime_batch_norm(" in pm.code
    out, want = pm(x), reference(x)
    torch.testing.assert_close(out, want)
    out.backward()
    want.backward()
    _assert_gradients_equal(pm, reference)
    torch.testing.assert_close(pm.state_dict()["bn.running_var"], reference.bn.running_var)


def test_pipeline_tensor_parallel_user_plan_smaller_batch_and_eval():
    """The user's plan; a batch below micro_batches and eval mode run their own programs, as eager."""
    reference = Stack().double()
    x, labels = _inputs()
    plan = {"layers.0": "column", "layers.1": "row", "head": "row"}
    pm = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=["layers.2"], tensor_parallel=plan,
                             micro_batches=4, example_inputs=(x, labels))  # fmt: skip
    assert pm.plan == {**plan, "layers.2": "replicate", "layers.3": "replicate"}
    for batch in (3, 1):
        torch.testing.assert_close(pm(x[:batch], labels[:batch])[1], reference(x[:batch], labels[:batch])[1])
    pm.eval()
    reference.eval()
    torch.testing.assert_close(pm(x, labels)[0], reference(x, labels)[0])


def test_pipeline_tensor_parallel_owns_its_shards_and_trains_them():
    """As tensor parallelism: the model is left as it was, an SGD step over pm.parameters() is the
    eager step, state_dict() has the model's keys with full tensors."""
    model, reference = Stack().double(), Stack().double()
    reference.load_state_dict(model.state_dict())
    x, labels = _inputs()
    pm = dpcompile.transform(model, ["cpu"] * 4, pipeline=2, tensor_parallel=True, micro_batches=2,
                             example_inputs=(x, labels))  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    for module, params in ((pm, pm.parameters()), (reference, reference.parameters())):
        optimizer = torch.optim.SGD(params, lr=0.5)
        module(x, labels)[1].backward()
        optimizer.step()
    assert list(pm.state_dict()) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value)
    assert all(p.grad is None for p in model.parameters())


def test_pipeline_tensor_parallel_meta_model_loads_a_checkpoint(tmp_path):
    """A model built on the meta device: each device allocates its shards, load_checkpoint fills them."""
    reference = Stack().double()
    x, labels = _inputs()
    real = dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 4, pipeline=2, tensor_parallel=True,
                               micro_batches=2, example_inputs=(x, labels))  # fmt: skip
    dpcompile.save_checkpoint(real, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Stack().double()
    pm = dpcompile.transform(model, ["cpu"] * 4, pipeline=2, tensor_parallel=True, micro_batches=2,
                             example_inputs=(x, labels))  # fmt: skip
    assert pm.needs_weights and all(not p.is_meta for p in pm.parameters())
    dpcompile.load_checkpoint(pm, tmp_path / "model.safetensors")
    torch.testing.assert_close(pm(x, labels)[1], reference(x, labels)[1])


def test_pipeline_tensor_parallel_code_stage_programs_and_explain():
    """pm.stages[i].code is one shard's program of the stage; explain shows each stage's devices, the
    parameters per device and the all-reduces among a stage's 2 devices."""
    x, labels = _inputs()
    pm = dpcompile.transform(Stack().double(), ["cpu"] * 4, pipeline=2, tensor_parallel=True, micro_batches=2,
                             example_inputs=(x, labels))  # fmt: skip
    stage1 = pm.stages[1].code
    assert "def forward(self, tanh_1, labels):" in stage1
    assert "tanh_1_copy = dpcompile_runtime_collectives_copy_to_shards(tanh_1)" in stage1
    assert "layers_3_all_reduce = dpcompile_runtime_collectives_reduce_from_shards(layers_3_partial)" in stage1
    report = dpcompile.explain(pm, x, labels).to_dict()
    assert [s["device"] for s in report["pipeline"]["stages"]] == ["cpu#0,cpu#1", "cpu#2,cpu#3"]
    total = sum(p.numel() * p.element_size() for p in pm.parameters())
    assert sum(report["param_bytes"].values()) == total and min(report["param_bytes"].values()) > 0
    reduce = next(c for c in report["collectives"] if c["name"] == "layers_3_all_reduce_mb1")
    assert reduce["elements"] == reduce["forward"] == 3 * 8  # micro-batch 1: 3 of 7 rows; ring 2(N-1)/N*S, N = 2


def test_pipeline_tensor_parallel_refuses_what_it_cannot_serve():
    """Devices that do not divide into the stages, and a boundary between a column layer and its row
    layer of an explicit plan, say so with the way out (the automatic plan unpairs them instead:
    tests/integration/test_composed_input_edges.py)."""
    with pytest.raises(ValueError, match=r"5 devices do not divide into 2 groups \(5 % 2 = 1\)"):
        dpcompile.transform(Stack(), ["cpu"] * 5, pipeline=2, tensor_parallel=True)
    with pytest.raises(DpCompileError, match="cuts through a tensor-parallel region"):
        dpcompile.transform(Stack(), ["cpu"] * 4, pipeline=["layers.1"],
                            tensor_parallel={"layers.0": "column", "layers.1": "row"})  # fmt: skip


def test_pipeline_tensor_parallel_places_every_value_on_its_gpu():
    """On 4 fake GPUs (FakeTensorMode raises on any op that mixes devices) forward runs: stage s's
    shard k and its values on cuda:{2s+k}, the stage's whole values on its first GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile.devices import parse_devices
    from dpcompile.recipes import PipelineRecipe

    model = Stack()
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        devices = parse_devices([f"cuda:{i}" for i in range(4)], check_available=False)
        recipe = PipelineRecipe(devices=devices, output_device=devices.primary, stages=2, micro_batches=2,
                                plan=True, check_available=False)  # fmt: skip
        pm = recipe.compile(model, None)
        with torch.no_grad():
            out = pm(torch.randn(7, 8, device="cuda:0"), torch.randint(0, 3, (7,), device="cuda:0"))
    placed = {name: str(p.device) for name, p in pm.named_parameters()}
    assert placed["layers.0.weight_shard1"] == "cuda:1" and placed["layers.1.bias"] == "cuda:0"
    assert placed["layers.2.weight_shard0"] == "cuda:2" and placed["layers.3.weight_shard1"] == "cuda:3"
    assert placed["layers.3.bias"] == "cuda:2"
    assert all(str(t.device) == "cuda:0" for t in out)
    assert "copy_to_devices(tanh_1_mb1_to_stage1, ['cuda:2', 'cuda:3'])" in pm.code


class ResidualStream(nn.Module):
    """Residual blocks on a stream the automatic plan shards end to end (``inp`` a column layer, each
    block's first layer a row layer reading it, its last a column layer added to it): no cut outside a
    column-to-row region but before the loss."""

    def __init__(self, width: int = 8, blocks: int = 4):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
                                    for _ in range(blocks))  # fmt: skip
        self.head = nn.Linear(width, 3)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return F.mse_loss(self.head(h), y)


def test_pipeline_tensor_parallel_cuts_a_sharded_residual_stream_where_the_work_is_shared():
    """Kept whole, the automatic plan's pairs left one cut: stage 0 held every block, stage 1 the loss
    alone (weights (all, 0)). A cut that starves a stage is given up for the balanced one, the pairs
    across it split; the loss and every gradient still equal eager's."""
    torch.manual_seed(0)
    model = ResidualStream().double()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 5, 6, dtype=torch.float64), torch.randn(8, 5, 3, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 4, pipeline=2, tensor_parallel=True, example_inputs=(x, y))
    assert pm.stage_plan.starts[1] == "blocks_2_0" and pm.stage_plan.weights[1] > 0.4 * sum(pm.stage_plan.weights)
    loss, want = pm(x, y), eager(x, y)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want)
    got = full_gradients(pm)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")
