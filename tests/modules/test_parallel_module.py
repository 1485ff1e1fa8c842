"""ParallelModule: shared state, checkpoints, modes, pickling and call-time checks."""

import copy
import io

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.modules.executors import PLAIN, executor_of
from tests.models import CNN, MLP


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.used(x) * self.scale + self.bias


@pytest.mark.parametrize(
    ("options", "executor"),
    [({}, "plain"), ({"tensor_parallel": True}, "plain"), ({"pipeline": 2, "micro_batches": 2}, "gpipe"),
     ({"pipeline": 2, "micro_batches": 2, "schedule": "1f1b"}, "1f1b")],
)  # fmt: skip
def test_every_layout_in_one_process_is_one_module_kind(options, executor):
    """Data parallel, tensor parallel, GPipe and 1F1B give a ParallelModule itself (fx's class for its code
    derives from it, from no subclass of a kind), run by the executor its name says, and so does a
    torch.save / torch.load copy, with the eager model's outputs (under no_grad: 1F1B runs forward only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pm = dpcompile.transform(model, ["cpu"] * 2, **options)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 8)
    for program in (pm, loaded):
        assert type(program).__mro__[1] is dpcompile.ParallelModule and program.executor == executor
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x))
    assert ("param_shards" in loaded.__dict__) == ("tensor_parallel" in options)
    for program in (pm, loaded):  # what tools ask the executor instead of its name
        asked = executor_of(program)
        assert (asked.runs_stages_in_one_process, asked.steps_one_f_one_b) == (executor != "plain", executor == "1f1b")
        assert not (asked.runs_one_stage_per_rank or asked.call_runs_under_dp(program) or asked.call_runs_under_fsdp(program))
    assert executor_of(model) is PLAIN  # a plain module: answered as the program itself would run


def test_parallel_module_shares_the_models_parameters():
    """pm.parameters() are the model's own tensors, moved to devices[0]."""
    model = WithUnused()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert [id(p) for p in pm.parameters()] == [id(p) for p in model.parameters()]


def test_parallel_module_state_dict_has_original_keys():
    """state_dict keys equal the model's: no 'module.' prefix, unused modules included."""
    model = WithUnused()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert list(pm.state_dict()) == list(model.state_dict())
    assert "scratch" not in pm.state_dict()


def test_parallel_module_state_dict_keeps_the_models_key_order():
    """Keys come in the model's order even when forward uses modules in another order."""

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)

        def forward(self, x):
            return self.first(self.second(x))

    model = Reversed()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert list(pm.state_dict()) == list(model.state_dict())


def test_parallel_module_load_state_dict_updates_model():
    """load_state_dict with the model's keys writes into the shared tensors."""
    model = WithUnused()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    other = WithUnused()
    pm.load_state_dict(other.state_dict())
    torch.testing.assert_close(model.used.weight, other.used.weight)


@pytest.mark.parametrize("layout", [{}, {"pipeline": 2}, {"mesh": {"pp": 2, "dp": 2}}, {"tensor_parallel": True}])
@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape", "not_a_tensor", "meta", "sparse"])
def test_a_load_state_dict_that_fails_changes_nothing(layout, damage):
    """A missing or unexpected key (strict), a tensor of another shape or a value that is no tensor
    raises torch's RuntimeError before anything is copied: torch's own load copied every key that fit
    first (data parallel and the pipelines left the program half loaded; tensor parallel checked each
    key just before copying it, so a bad last key left the first ones written). So does a meta or a
    sparse tensor, which ``copy_`` refuses midway (before: every key before it loaded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    pm = dpcompile.transform(model, ["cpu"] * (4 if "mesh" in layout else 2), example_inputs=(torch.randn(4, 4),),
                             **layout)  # fmt: skip
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in before.items()}
    if damage == "missing":
        del state["2.bias"]
    elif damage == "unexpected":
        state["3.weight"] = torch.zeros(1)
    elif damage == "shape":
        state["2.bias"] = torch.zeros(5)
    elif damage == "meta":
        state["2.bias"] = torch.zeros(4, device="meta")
    elif damage == "sparse":
        state["2.bias"] = torch.zeros(4).to_sparse()
    else:
        state["2.bias"] = [0.0] * 4
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        pm.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in pm.state_dict().items())
    if damage in ("missing", "unexpected"):
        pm.load_state_dict(state, strict=False)  # what fits is loaded, as torch does
        assert torch.equal(pm.state_dict()["0.weight"], torch.zeros(8, 4))


def test_parallel_module_optimizer_over_model_parameters_trains_pm():
    """An optimizer built on model.parameters() changes what pm computes."""
    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8)
    before = pm(x).detach()
    pm(x).pow(2).mean().backward()
    opt.step()
    assert not torch.allclose(pm(x), before)


def test_parallel_module_train_eval_follow_model():
    """train()/eval() switch the modules the program calls, as on the original."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    pm.eval()
    assert not model[1].training
    x = torch.randn(8, 4)
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    assert model[1].training


def test_parallel_module_torch_save_round_trip():
    """torch.save / torch.load(weights_only=False) give a module with identical outputs."""
    model = CNN()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    pm.eval()
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, dpcompile.ParallelModule)
    x = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(loaded(x), pm(x))
    torch.testing.assert_close(loaded(x[:2]), pm(x[:2]))
    assert list(loaded.state_dict()) == list(model.state_dict())
    assert loaded.code == pm.code


def test_parallel_module_rejects_mismatched_batch_sizes_naming_the_argument():
    """Split inputs that disagree on the batch size raise ValueError naming them."""

    class Two(nn.Module):
        def forward(self, x, y):
            return x + y.sum()

    pm = dpcompile.transform(Two(), ["cpu"] * 2)
    with pytest.raises(ValueError, match=r"argument 'y' has batch size 3 .* 'x' has 4"):
        pm(torch.randn(4, 2), torch.randn(3, 2))


def test_parallel_module_rejects_empty_batch():
    """A batch of size 0 raises ValueError instead of running empty replicas."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2)
    with pytest.raises(ValueError, match="empty batch"):
        pm(torch.randn(0, 8))


def test_transform_moves_model_to_primary_and_changes_nothing_else():
    """The model keeps its parameters, values and structure."""
    model = CNN()
    before = copy.deepcopy(model.state_dict())
    dpcompile.transform(model, ["cpu"] * 2)
    after = model.state_dict()
    assert list(before) == list(after)
    for key in before:
        assert torch.equal(before[key], after[key])


def test_transform_rejects_bad_batch_dim_and_output_device():
    """batch_dim and output_device are validated with ValueError."""
    with pytest.raises(ValueError, match="batch_dim"):
        dpcompile.transform(MLP(), ["cpu"] * 2, batch_dim=-1)
    with pytest.raises(ValueError, match="cannot parse"):
        dpcompile.transform(MLP(), ["cpu"] * 2, output_device="nowhere")


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))


def test_parallel_module_small_batch_keeps_the_models_eval_mode():
    """model.eval() holds for a batch smaller than the device count (no silent switch back to training)."""
    model = _dropout_model()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    model.eval()
    x = torch.randn(2, 8)
    torch.testing.assert_close(pm(x), model(x))
    assert not model[1].training


def test_parallel_module_torch_save_keeps_mixed_modes():
    """A module frozen in eval inside a training model stays in eval after torch.save/torch.load."""
    model = _dropout_model()
    model[1].eval()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.training and not loaded.get_submodule("1").training
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model(x))


class ConstantInForward(nn.Module):
    """A tensor made in forward: the tracer keeps it as ``_tensor_constant0`` on the program."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_parallel_module_state_dict_leaves_out_traced_constants():
    """pm.state_dict() has exactly the model's keys, and the model's state dict loads into pm."""
    model = ConstantInForward()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    assert list(pm.state_dict()) == list(model.state_dict())
    pm.load_state_dict(model.state_dict())


class FunctionalDropout(nn.Module):
    """Reads ``self.training`` in forward: fx would bake the mode of the trace into the code."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.fc(x), 0.5, self.training)


def test_parallel_module_eval_follows_self_training_read_in_forward():
    """pm.eval() (and model.eval()) turn off F.dropout(training=self.training); pm.train() turns it on."""
    model = FunctionalDropout()
    pm = dpcompile.transform(model, ["cpu"] * 3)
    x = torch.randn(7, 8)
    pm.eval()
    assert not model.training
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x[:2]), model(x[:2]))
    pm.train()
    assert (pm(x) == 0).any()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))


def test_parallel_module_torch_save_keeps_following_the_mode():
    """After torch.save/torch.load, eval() still reaches a self.training read in forward."""
    model = FunctionalDropout()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.eval()
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_parallel_module_deepcopy_is_an_independent_working_copy():
    """copy.deepcopy(pm) (an EMA, a snapshot) runs, matches, and shares no tensors with pm."""
    import copy

    pm = dpcompile.transform(_dropout_model().eval(), ["cpu"] * 3)
    twin = copy.deepcopy(pm)
    x = torch.randn(5, 8)
    torch.testing.assert_close(twin(x), pm(x))
    torch.testing.assert_close(twin(x[:2]), pm(x[:2]))
    assert all(a is not b for a, b in zip(twin.parameters(), pm.parameters()))


def test_parallel_module_has_no_module_attribute_and_says_why():
    """pm.module (DataParallel's habit): an AttributeError saying pm is no wrapper, not a bare one;
    a model's own submodule named ``module`` is still found."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2)
    with pytest.raises(AttributeError, match=r"no attribute 'module': a ParallelModule is no wrapper"):
        pm.module  # noqa: B018

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = MLP()

        def forward(self, x):
            return self.module(x)

    holder = Holder()
    pm = dpcompile.transform(holder, ["cpu"] * 2)
    assert pm.module is holder.module
    scaled = MLP()
    scaled.register_buffer("module", torch.ones(1))  # a buffer of that name, too
    assert dpcompile.transform(scaled, ["cpu"] * 2).module is scaled.module


def test_parallel_module_compile_in_place_matches_eager():
    """pm.compile() makes pm(x) run compiled, with the eager model's outputs and gradients; a copy runs eagerly."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    pm.compile()
    x = torch.randn(6, 8)
    out = pm(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert pm.__dict__["_compiled_call_impl"] is not None
    assert copy.deepcopy(pm).__dict__.get("_compiled_call_impl") is None


def test_parallel_module_call_goes_straight_to_its_own_call():
    """pm(x) calls ParallelModule.__call__ directly (not fx's wrapper); an error in the program still
    raises with the generated line in its traceback."""
    import traceback

    pm = dpcompile.transform(MLP(), ["cpu"] * 2)
    assert type(pm).__call__ is dpcompile.ParallelModule.__call__
    with pytest.raises(RuntimeError) as info:
        pm(torch.randn(4, 5))  # 5 features where fc1 takes 8
    assert any("replica_dev0.fc1(x_dev0)" in (frame.line or "") for frame in traceback.extract_tb(info.value.__traceback__))
