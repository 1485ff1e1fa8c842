"""``data_parallel="fsdp"`` over a device list: each parameter stored as one piece per dp copy (the
only stored copy, balanced as ``tensor_split`` cuts), gathered where it is read; the model's state
dict, explain's bytes per device, the calls that need another program, and what is refused.
(Training against eager in every layout: ``test_layout_matrix.py``; checkpoints:
``test_training_checkpoint_fsdp_one_process.py``.)"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import DpCompileError
from dpcompile.export import ExportError
from dpcompile.modules.fsdp_one_process import GATHERED, GatherShards
from tests.helpers import assert_steps_equal_eager
from tests.test_layouts import Stack


class Uneven(nn.Module):
    """Rows that 3 copies cannot split evenly (10 and 5), and a 0-dim parameter."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 10), nn.Linear(10, 5)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _pieces(pm):
    return {name: tuple(p.shape) for name, p in pm.named_parameters()}


def test_each_parameter_is_one_piece_per_copy_and_the_state_dict_is_the_models():
    """3 copies: rows 10 -> 4, 3, 3 and 5 -> 2, 2, 1; the 0-dim scale stays whole; the state dict
    has the model's keys and tensors; the model given keeps its own parameters whole."""
    torch.manual_seed(0)
    model = Uneven()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    pm = dpcompile.transform(model, ["cpu"] * 3, data_parallel="fsdp")
    assert _pieces(pm) == {
        **{f"fc1.parametrizations.weight.original{r}": (n, 4) for r, n in enumerate((4, 3, 3))},
        **{f"fc1.parametrizations.bias.original{r}": (n,) for r, n in enumerate((4, 3, 3))},
        **{f"fc2.parametrizations.weight.original{r}": (n, 10) for r, n in enumerate((2, 2, 1))},
        **{f"fc2.parametrizations.bias.original{r}": (n,) for r, n in enumerate((2, 2, 1))},
        "scale": (),
    }
    state = pm.state_dict()
    assert list(state) == list(before)
    for key, value in before.items():
        assert torch.equal(state[key], value), key
    assert list(model.parameters()) == params and type(model.fc1) is nn.Linear  # the model is not sharded
    x = torch.randn(7, 4)
    torch.testing.assert_close(pm(x), model(x))


def test_load_state_dict_cuts_the_pieces_and_refuses_a_wrong_shape():
    torch.manual_seed(0)
    pm = dpcompile.transform(Uneven(), ["cpu"] * 3, data_parallel="fsdp")
    other = Uneven()
    pm.load_state_dict(other.state_dict())
    assert torch.equal(pm.get_parameter("fc1.parametrizations.weight.original1"), other.fc1.weight[4:7])
    for key, value in other.state_dict().items():
        assert torch.equal(pm.state_dict()[key], value), key
    wrong = {**other.state_dict(), "fc2.weight": torch.zeros(6, 10)}
    with pytest.raises(RuntimeError, match="size mismatch for fc2.weight"):
        pm.load_state_dict(wrong)


def test_explain_counts_each_piece_on_its_copys_device():
    """Parameter bytes per device are the replicated program's divided by dp, in every layout."""
    torch.manual_seed(0)
    model = Stack()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for layout, n in (({"dp": 2}, 2), ({"dp": 2, "tp": 2}, 4), ({"pp": 2, "dp": 2}, 4)):
        replicated = dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh=layout)
        sharded = dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh=layout, data_parallel="fsdp")
        full = dpcompile.explain(replicated, torch.randn(8, 8)).param_bytes
        held = dpcompile.explain(sharded, torch.randn(8, 8)).param_bytes
        assert sum(held.values()) == total, (layout, held)
        assert held == {label: size // 2 for label, size in full.items()}, (layout, held, full)


def test_distinct_devices_hold_piece_r_on_copy_r_and_train_like_eager():
    """dp x tp over cpu:0..3: copy 0 runs on cpu:0, cpu:1 and copy 1 on cpu:2, cpu:3, so the pieces
    of the shard copy 0 holds on cpu:1 lie on cpu:1 and cpu:3, gathered to cpu:1 (pm.code's head
    says so; a row-parallel shard's pieces split its own dim, 1); 2 AdamW steps equal eager's; verify on fake
    CUDA devices passes; eval and a smaller batch (programs built again) give eager's outputs."""
    torch.manual_seed(0)
    model, reference = Stack(), Stack()
    reference.load_state_dict(model.state_dict())
    devices = [f"cpu:{k}" for k in range(4)]
    pm = dpcompile.transform(model, devices, mesh={"dp": 2, "tp": 2}, data_parallel="fsdp")
    gathers = {path: m for path, m in pm.named_modules() if isinstance(m, GatherShards)}
    first = gathers["layers.0.0.parametrizations.weight_shard0.0"]
    assert (first.piece_devices, first.device) == (("cpu:0", "cpu:2"), "cpu:0")
    second = gathers["layers.0.0.parametrizations.weight_shard1.0"]
    assert (second.piece_devices, second.device) == (("cpu:1", "cpu:3"), "cpu:1")
    assert "# layers.0.0.weight_shard1 = gather(original0 on cpu:1, original1 on cpu:3, dim 0) on cpu:1\n" in pm.code
    assert "# layers.0.2.weight_shard0 = gather(original0 on cpu:0, original1 on cpu:2, dim 1) on cpu:0\n" in pm.code
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.randn(8, 8)
        loss, expected = pm(x), reference(x)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pm.state_dict()[key], value, msg=key)
    assert dpcompile.verify(pm, reference, torch.randn(8, 8), fake_devices=4)
    pm.eval()
    reference.eval()
    with torch.no_grad():
        for x in (torch.randn(8, 8), torch.randn(3, 8)):
            torch.testing.assert_close(pm(x), reference(x))


@pytest.mark.parametrize(("layout", "n"), [({"dp": 2}, 2), ({"dp": 2, "tp": 2}, 4), ({"pp": 2, "dp": 2}, 4)])
def test_no_whole_parameter_outlives_forward(layout, n):
    """After forward, no parameter gathered for it is alive (autograd saved how to gather it, and
    backward gathers it again); backward still gives eager's gradients (as the layout matrix checks)."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, mesh=layout, data_parallel="fsdp")
    own = {id(m) for m in pm.modules()}
    x = torch.randn(8, 8)
    loss = pm(x)
    gc.collect()
    assert not [g for g, _ in list(GATHERED.values()) if id(g) in own]
    loss.backward()
    reference(x).backward()
    grads = {name: p.grad for name, p in pm.named_parameters()}
    for key, (spec, names) in pm.param_shards.items():
        whole = torch.cat([grads[name] for name in names], spec.dim)
        torch.testing.assert_close(whole, reference.get_parameter(key).grad, msg=key)


def test_meta_model_is_filled_by_load_checkpoint(tmp_path):
    """A model built on meta, sharded over dp x tp, filled from a replicated program's checkpoint."""
    torch.manual_seed(0)
    reference = Stack()
    dpcompile.save_checkpoint(dpcompile.transform(copy.deepcopy(reference), ["cpu"] * 2), tmp_path / "ckpt")
    with torch.device("meta"):
        meta = Stack()
    pm = dpcompile.transform(meta, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, data_parallel="fsdp")
    assert pm.needs_weights
    dpcompile.load_checkpoint(pm, tmp_path / "ckpt")
    x = torch.randn(8, 8)
    with torch.no_grad():
        torch.testing.assert_close(pm(x), reference(x))


@pytest.mark.parametrize(
    ("options", "message"),
    [({"tensor_parallel": True}, r"layout \{'tp': 2\} has none"),
     ({"mixed_precision": object()}, "mixed_precision= is FSDP2's"),
     ({"memory_per_device": "1GiB"}, "memory_per_device= does not predict")],
)  # fmt: skip
def test_what_one_process_fsdp_refuses_is_named(options, message):
    with pytest.raises(DpCompileError, match=message):
        dpcompile.transform(Stack(), ["cpu"] * 2, data_parallel="fsdp", **options)


def test_pickling_a_models_own_parametrization_is_refused_with_the_way_out(tmp_path):
    """FSDP programs pickle and export (test_fsdp_one_process_portable.py), but not a weight_norm of the
    model's, which torch does not pickle (as for replication): refused by name, the program unchanged."""
    model = Stack()
    nn.utils.parametrizations.weight_norm(model.layers[0][0])
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp")
    before = {name: p.clone() for name, p in pm.named_parameters()}
    with pytest.raises(DpCompileError, match="layers.0.0.weight is parametrized by the model.*save_checkpoint"):
        pickle.dumps(pm)
    with pytest.raises(ExportError, match="weight_norm.*save_checkpoint"):
        dpcompile.export(pm, tmp_path / "wn")
    assert not (tmp_path / "wn").exists()
    assert all(torch.equal(p, before[name]) for name, p in pm.named_parameters())


@pytest.mark.parametrize(
    ("options", "n"),
    [({"copy_replicas": True}, 2), ({"activation_checkpointing": True}, 2),
     ({"mesh": {"pp": 2, "dp": 2}, "activation_checkpointing": True}, 4)],
    ids=["copy_replicas", "checkpointing", "pp_dp_checkpointing"],
)  # fmt: skip
def test_fsdp_with_real_replicas_or_recompute_gives_eagers_gradients(options, n):
    """Real replicas on virtual devices (distinct GPUs' code path) and activation checkpointing
    (backward recomputes, reading the parameters again): the loss and every gradient equal eager's."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * n, data_parallel="fsdp", **options)
    x = torch.randn(8, 8)
    loss, expected = pm(x), reference(x)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    grads = {name: p.grad for name, p in pm.named_parameters()}
    for key, (spec, names) in pm.param_shards.items():
        torch.testing.assert_close(torch.cat([grads[name] for name in names], spec.dim), reference.get_parameter(key).grad)


class ReadsItsWeight(nn.Module):
    """forward reads a parameter itself (``self.fc.weight.sum()``) besides calling its module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), self.fc.weight.sum()


def test_a_mode_traced_inside_a_call_runs_on_tensors_not_on_cached_proxies():
    """The first eval call traces the eval program inside the program's ``parametrize.cached()``: the
    weight read while tracing was cached as a proxy, and the run after returned fx proxies."""
    model = ReadsItsWeight()
    eager = copy.deepcopy(model)
    x = torch.randn(5, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", example_inputs=(x,))
    pm.eval(), eager.eval()
    with torch.no_grad():
        got, want = pm(x), eager(x)
    assert all(type(t) is torch.Tensor for t in got)
    torch.testing.assert_close(got, want)


class ModeBranch(nn.Module):
    """Forward reads the mode (export bakes it in: one program per mode, merged), and the class names
    ``_parameters`` (so the guard of the exported program watches that attribute of its leaves; the
    head's holds a None bias once sharding moved its weight into a parametrization, as GPT-2's)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = nn.functional.dropout(self.fc(x), 0.0, self.training)
        return self.head(h).sum()

    def own_tensors(self):
        return len(self.head._parameters)


def test_an_exported_program_runs_in_the_other_mode():
    """Sharding swaps each Linear for a parametrized class, which the exported program's guard did
    not read again (ModelChanged at pm.eval()), and the other mode, captured at its first call from
    the sharded copy, ran the training path ('exported in training mode'): both modes are captured
    before sharding, and the guard reads the model afresh."""
    model, x = ModeBranch(), torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", frontend="export", example_inputs=(x,))
    torch.testing.assert_close(pm(x), model(x))
    with torch.no_grad():
        torch.testing.assert_close(pm.eval()(x), model.eval()(x))


class ScaledInTraining(nn.Module):
    """Reads its mode (export captures the other mode at its first call in it) and, as transformers'
    code does, its own ``_parameters`` dict."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8, bias=False), nn.Linear(8, 2, bias=False)

    def forward(self, x):
        scale = 2.0 if self.training else 1.0
        if "extra" in self._parameters:
            scale = scale + 1.0
        return self.head(self.fc(x) * scale)


def test_an_exported_program_switches_modes_on_its_pieces():
    """pm.eval() / pm.train() on a program torch.export captured: the other mode is captured before the
    parameters become pieces (was 'exported in training mode ... transform again'), and splitting them is
    no change of the model (was ModelChanged: 'fc._parameters' changed)."""
    torch.manual_seed(0)
    model = ScaledInTraining().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, frontend="export", example_inputs=(x,), data_parallel="fsdp")
    for mode in ("train", "eval", "train"):
        getattr(pm, mode)()
        getattr(reference, mode)()
        torch.testing.assert_close(pm(x), reference(x), msg=lambda m, mode=mode: f"{mode}: {m}")
    pm(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(pm.state_dict(), reference.state_dict())
    grads = {key: dpcompile.runtime.tensor_parallel.unshard([pm.get_parameter(n).grad for n in names], spec, "cpu")
             for key, (spec, names) in pm.param_shards.items()}  # fmt: skip
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


class RootParameterAndModeBranch(nn.Module):
    """A parameter of the root itself (ViT's ``pos_embed``) and a forward that reads the mode, so
    the other mode is a program traced again from the root."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 2)
        self.pos = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.fc(x + self.pos)
        return self.head(h * 2 if self.training else h)


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"pp": 2, "dp": 2}])
def test_the_other_mode_reads_a_root_parameters_pieces_after_a_step(mesh):
    """The eval program, traced from the root's private copy, read the root parameter's whole
    tensor from before the pieces were made: after an optimizer step, eval outputs were stale."""
    torch.manual_seed(0)
    model = RootParameterAndModeBranch().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2 * len(mesh), mesh=mesh, data_parallel="fsdp", example_inputs=(x,))
    for module in (pm, reference):
        module(x).sum().backward()
        torch.optim.SGD(module.parameters(), lr=0.5).step()
    pm.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), reference(x))


def test_a_program_traced_again_under_tp_reads_the_pieces_after_a_step():
    """``{"dp": 2, "tp": 2}``: a program built for another call (a batch of 1, fewer rows than copies;
    the other mode) copied each sharded weight it reads as the tensor gathered when it was built (a
    buffer): after an optimizer step its outputs and gradients were the old weights'."""
    torch.manual_seed(0)
    model = RootParameterAndModeBranch().double()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh={"dp": 2, "tp": 2}, data_parallel="fsdp")
    x = torch.randn(1, 8, dtype=torch.float64)
    assert_steps_equal_eager(pm, reference, lambda step: (x,), lambda params: torch.optim.SGD(params, lr=0.5))
    pm.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), reference(x))


class HasStages(nn.Module):
    """A submodule named ``stages`` (timm's MetaFormer, PoolFormer)."""

    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.stages(x))


def test_a_submodule_named_stages_is_not_taken_for_pipeline_stages():
    """Placing the pieces read ``pm.stages`` and got the model's Sequential: AttributeError
    ('Sequential' object has no attribute 'module_paths')."""
    torch.manual_seed(0)
    model = HasStages()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", example_inputs=(x,))
    torch.testing.assert_close(pm(x), reference(x))
    torch.testing.assert_close(pm.state_dict(), reference.state_dict())


class BatchNormAct(nn.BatchNorm1d):
    """timm's ``BatchNormAct2d``: a BatchNorm subclass of another module whose forward adds an activation."""

    def forward(self, x):
        h = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training)
        return torch.relu(h) * 3


class NormActNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(8, 8), BatchNormAct(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def test_the_other_mode_traces_a_parametrized_module_as_its_own_class():
    """The eval program, traced after the pieces made each module a ``Parametrized*`` class of
    torch.nn, took ``BatchNormAct`` for a plain BatchNorm leaf and dropped its activation."""
    torch.manual_seed(0)
    model = NormActNet()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel="fsdp", example_inputs=(x,))
    pm.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), reference(x))


def test_overlapping_calls_that_end_out_of_order_leave_no_gather_behind():
    """Two calls (threads) inside gathered_once_per_device ending in either order: once both are out, no whole
    weight is kept (a later call after an optimizer step must gather the pieces afresh)."""
    from dpcompile.modules import fsdp_gather

    first, second = fsdp_gather.gathered_once_per_device(), fsdp_gather.gathered_once_per_device()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert fsdp_gather._THIS_CALL is not None  # the second call still runs: it keeps its gathers
    second.__exit__(None, None, None)
    assert fsdp_gather._THIS_CALL is None
