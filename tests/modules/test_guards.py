"""What a data-parallel program was specialised on is checked at call time, as torch.compile's
guards are: hooks, the model's submodules and parameters, the attributes forward reads. A call
after any of them changed runs a program traced for the model as it is now."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import dpcompile


class Residual(nn.Module):
    """A container forward enters (``block``), a leaf (``fc2``), a root parameter, a flag attribute."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.fc2 = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.use_residual = True
        self.epoch = 0  # an attribute forward never reads

    def forward(self, x):
        h = self.block(x)
        if self.use_residual:
            h = h + x
        return self.fc2(h) * self.gain


def _pair() -> tuple[Residual, dpcompile.ParallelModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Residual()
    return model, dpcompile.transform(model, ["cpu"] * 2), torch.randn(6, 8)


def _same(pm: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    torch.testing.assert_close(pm(x), model(x), atol=1e-6, rtol=1e-6)


def test_guard_container_hook_registered_after_transform_applies():
    """A forward hook on a submodule forward enters, added after transform, changes pm's output as the model's."""
    model, pm, x = _pair()
    handle = model.block.register_forward_hook(lambda module, args, out: out * 3)
    _same(pm, model, x)
    handle.remove()
    _same(pm, model, x)


def test_guard_container_hook_removed_after_transform_stops_applying():
    """A hook registered before transform and removed after no longer applies (it was traced in)."""
    torch.manual_seed(0)
    model = Residual()
    handle = model.block.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    _same(pm, model, x)
    handle.remove()
    _same(pm, model, x)


def test_guard_root_hooks_run_around_the_program():
    """Forward hooks and pre-hooks on the model itself run as model(x) runs them, before or after transform."""
    torch.manual_seed(0)
    model = Residual()
    before = model.register_forward_hook(lambda module, args, out: out + 1)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    _same(pm, model, x)
    after = model.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    _same(pm, model, x)
    before.remove(), after.remove()
    _same(pm, model, x)


def test_guard_swapped_submodule_is_used_and_saved():
    """model.fc2 = nn.Linear(...) after transform: pm runs and saves the new layer."""
    model, pm, x = _pair()
    model.fc2 = nn.Linear(8, 8)
    _same(pm, model, x)
    assert torch.equal(pm.state_dict()["fc2.weight"], model.fc2.weight)
    assert any(p is model.fc2.weight for p in pm.parameters())


def test_guard_reassigned_root_parameter_is_used():
    """model.gain = nn.Parameter(...) after transform: pm multiplies by the new one."""
    model, pm, x = _pair()
    model.gain = nn.Parameter(torch.full((8,), 0.5))
    _same(pm, model, x)


def test_guard_attribute_forward_reads_is_followed():
    """model.use_residual = False after transform: pm takes the branch without the residual."""
    model, pm, x = _pair()
    model.use_residual = False
    _same(pm, model, x)
    model.use_residual = True
    _same(pm, model, x)


def test_guard_attribute_forward_never_reads_traces_nothing():
    """An attribute the model's code never mentions (a training loop's epoch) costs no program."""
    model, pm, x = _pair()
    for epoch in range(3):
        model.epoch = epoch
        assert pm.program_for_call(x) is pm
    assert len(pm.program_cache) == 0


@pytest.mark.parametrize("copy_replicas", [False, True])
def test_guard_leaf_module_hooks_see_the_whole_batch(copy_replicas):
    """A torch.nn layer, an RNN or a leaf_modules= class with a forward hook at transform runs once on the whole
    batch, so its hooks (and one registered on it after, as fc's pre-hook) see what eager's do
    (docs/data_parallel.md, Hooks). Split, they ran once per replica on a chunk: a hook's ``out.mean()`` was the
    last chunk's."""

    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.rnn = nn.GRU(4, 4, batch_first=True)
            self.leaf = Leaf()

        def forward(self, x):
            h, _ = self.rnn(self.fc(x))
            return self.leaf(h)

    model = Model()
    seen: dict[str, list[int]] = {"fc": [], "rnn": [], "leaf": [], "fc_pre": []}
    model.fc.register_forward_hook(lambda m, args, out: seen["fc"].append(out.shape[0]))
    model.rnn.register_forward_hook(lambda m, args, out: seen["rnn"].append(out[0].shape[0]))
    pm = dpcompile.transform(model, ["cpu", "cpu"], leaf_modules=[Leaf], copy_replicas=copy_replicas)
    model.leaf.register_forward_hook(lambda m, args, out: seen["leaf"].append(out.shape[0]))  # after transform
    model.fc.register_forward_pre_hook(lambda m, args: seen["fc_pre"].append(args[0].shape[0]))
    x = torch.randn(6, 5, 4)
    torch.testing.assert_close(pm(x), model.leaf(model.rnn(model.fc(x))[0]))
    # the eager check above added one whole-batch call to each hook, after the program's
    assert seen == {"fc": [6, 6], "rnn": [6, 6], "leaf": [6, 6], "fc_pre": [6, 6]}, seen


def _store_mean(module, args, output):
    module.stat = output[0].detach().mean()


def test_guard_batch_statistic_of_an_rnn_hook_is_eager_s():
    """A forward hook on an RNN storing ``out.mean()``: it was the last replica's chunk's mean under data
    parallelism (-0.044 for -0.028); the RNN now runs whole, so the statistic and the output are eager's."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 5, batch_first=True)
            self.fc = nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1])

    model = Model()
    model.rnn.register_forward_hook(_store_mean)
    x = torch.randn(6, 3, 4)
    pm = dpcompile.transform(model, ["cpu", "cpu"], example_inputs=(x,))
    out = pm(x)
    got = model.rnn.stat
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(got, model.rnn.stat)


class Configured(nn.Module):
    """Forward reads a list, a tuple, a function, a dtype and a leaf child's attribute (``self.norm.eps``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.scales = [1.0, 2.0]
        self.dims = (1,)
        self.act = torch.relu
        self.dtype = torch.float32

    def forward(self, x):
        h = self.act(self.fc(x))
        for s in self.scales:
            h = h * s
        h = nn.functional.layer_norm(h, (8,), self.norm.weight, self.norm.bias, self.norm.eps)
        return h.to(self.dtype).amax(self.dims)


def _configured() -> tuple[Configured, dpcompile.ParallelModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Configured()
    return model, dpcompile.transform(model, ["cpu"] * 2), torch.randn(6, 8)


def _same_typed(pm: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    out, expected = pm(x), model(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected)


def test_guard_list_attribute_replaced_or_changed_in_place_is_followed():
    """model.scales = [3.0], then model.scales.append(5.0) (no dict version changes): pm follows both."""
    model, pm, x = _configured()
    model.scales = [3.0]
    _same_typed(pm, model, x)
    model.scales.append(5.0)
    _same_typed(pm, model, x)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "dims", (0, 1)),
        lambda m: setattr(m, "act", torch.tanh),
        lambda m: setattr(m, "dtype", torch.float64),
        lambda m: setattr(m.norm, "eps", 10.0),
    ],
    ids=["tuple", "function", "dtype", "leaf_child_attribute"],
)
def test_guard_non_scalar_attribute_forward_reads_is_followed(change):
    """A tuple, a function, a dtype, or an attribute of a leaf child that forward reads, changed after transform."""
    model, pm, x = _configured()
    change(model)
    _same_typed(pm, model, x)


def test_guard_forward_replaced_on_a_container_instance_is_followed():
    """model.block.forward = ... after transform: pm runs the new forward."""
    model, pm, x = _pair()
    model.block.forward = lambda h: h * 0 + 1
    _same(pm, model, x)


def test_guard_container_hook_variants_apply():
    """with_kwargs, prepend and always_call forward hooks, and a with_kwargs pre-hook, on containers after transform."""
    model, pm, x = _pair()
    model.block.register_forward_hook(lambda m, args, kwargs, out: out * 2, with_kwargs=True)
    model.block.register_forward_hook(lambda m, args, out: out + 1, prepend=True)
    model.block.register_forward_hook(lambda m, args, out: out - 3, always_call=True)
    model.block.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
    _same(pm, model, x)


def test_guard_global_module_hooks_apply_and_stop_applying():
    """A global forward hook and pre-hook (register_module_forward_*_hook) registered after transform, then removed."""
    model, pm, x = _pair()
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: out * 2 if isinstance(m, nn.Sequential) else None
    )
    pre = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: (args[0] + 1,) if isinstance(m, nn.Sequential) else None
    )
    try:
        _same(pm, model, x)
    finally:
        hook.remove(), pre.remove()
    _same(pm, model, x)


def _grads(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    module(x).pow(2).sum().backward()
    return x.grad


def test_guard_root_backward_hooks_run_as_on_the_model():
    """Full backward hooks and pre-hooks on the model itself change the input gradient as eager, once per backward."""
    model, pm, x = _pair()
    calls = []
    model.register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 3,))
    model.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(m) or (grad_in[0] * 2,))
    torch.testing.assert_close(_grads(pm, x), _grads(model, x))
    assert calls == [model, model]


def test_guard_container_backward_hook_is_refused_not_skipped():
    """A backward hook on a module forward is traced through cannot run: the call says so and how to
    keep it (leaf_modules=), which then runs the hook as eager does."""
    model, pm, x = _pair()
    handle = model.block.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 2,))
    with pytest.raises(dpcompile.DpCompileError, match=r"leaf_modules=\[Sequential\]"):
        pm(x)
    torch.manual_seed(0)
    leafy = dpcompile.transform(model, ["cpu"] * 2, leaf_modules=[nn.Sequential])
    torch.testing.assert_close(_grads(leafy, x), _grads(model, x))
    handle.remove()
    _same(pm, model, x)


def test_guard_root_state_dict_hooks_run_as_on_the_model():
    """The model's own state_dict post-hook and load_state_dict pre-hook run on pm.state_dict() / pm.load_state_dict()."""
    model, pm, x = _pair()

    def add_step(module, state, prefix, metadata):
        state[prefix + "step"] = torch.tensor(7)

    def drop_step(state, prefix, *rest):
        state.pop(prefix + "step", None)

    model._register_state_dict_hook(add_step)
    model._register_load_state_dict_pre_hook(drop_step)
    assert pm.state_dict().keys() == model.state_dict().keys()
    assert int(pm.state_dict()["step"]) == 7
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    pm.load_state_dict(state)
    assert torch.equal(model.gain, torch.zeros(8))
    _same(pm, model, x)


def test_guard_tensor_parallel_hook_on_a_program_container_is_refused():
    """A hook added to a submodule of a tensor-parallel program after transform is refused, never skipped."""
    torch.manual_seed(0)
    model = Residual()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    x = torch.randn(6, 8)
    handle = pm.block.register_forward_hook(lambda m, args, out: out * 2)
    with pytest.raises(dpcompile.DpCompileError, match="before dpcompile.transform"):
        pm(x)
    handle.remove()
    torch.testing.assert_close(pm(x), model(x))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.to(torch.float64),
        lambda m: m.block.eval(),
        lambda m: delattr(m, "fc2") or setattr(m, "fc2", nn.Identity()),
        lambda m: m.block[0].weight.requires_grad_(False),
    ],
    ids=["float64", "child_eval", "deleted_and_replaced", "frozen_parameter"],
)
def test_guard_model_changed_after_transform_is_followed(change):
    """The model converted to float64, a child put in eval, a submodule deleted and replaced, a parameter frozen."""
    model, pm, x = _pair()
    change(model)
    x = x.to(model.gain.dtype)
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(_grads(pm, x), _grads(model, x))


class Switched(nn.Module):
    """The parent reads attributes of a child container: ``self.block.enabled``, ``self.block.gain``."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.block.enabled = True
        self.block.gain = 1
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.block(x) if self.block.enabled else x
        return self.head(h * self.block.gain)


@pytest.mark.parametrize("n", [2, 3])
def test_guard_child_attribute_the_parent_reads_is_followed(n):
    """model.block.enabled = False, model.block.gain = 3 after transform (read by the parent's forward)."""
    torch.manual_seed(0)
    model = Switched()
    pm = dpcompile.transform(model, ["cpu"] * n)
    x = torch.randn(7, 8)
    model.block.enabled = False
    _same(pm, model, x)
    model.block.gain = 3
    _same(pm, model, x)


def test_guard_copies_made_after_a_change_follow_the_model():
    """A deep copy and a torch.save round trip of pm, made after the model changed, run the model as it is now."""
    import io

    model, pm, x = _pair()
    model.use_residual = False
    copied = copy.deepcopy(pm)
    torch.testing.assert_close(copied(x), model(x))
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), model(x))


def test_guard_export_after_a_change_is_refused(tmp_path):
    """Exporting a program whose model changed since transform says to transform again (no stale program)."""
    model, pm, x = _pair()
    model.use_residual = False
    with pytest.raises(dpcompile.DpCompileError, match="transform again"):
        dpcompile.export(pm, tmp_path / "out")


def test_guard_tensor_parallel_attribute_changed_on_the_program_is_refused():
    """pm.block.gain changed on a tensor-parallel program: refused, naming it; pm.eval()/train() are not changes."""
    torch.manual_seed(0)
    model = Switched()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True)
    x = torch.randn(6, 8)
    pm.eval()
    pm.train()
    torch.testing.assert_close(pm(x), model(x))
    pm.block.gain = 3
    with pytest.raises(dpcompile.DpCompileError, match=r"block\.gain"):
        pm(x)


def test_guard_deleted_submodule_leaves_the_state_dict():
    """del model.fc2 (forward checks hasattr) after transform: pm skips it and its keys leave pm.state_dict()."""

    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.fc2 = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return self.fc2(h) if hasattr(self, "fc2") else h

    torch.manual_seed(0)
    model = Optional()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(5, 8)
    del model.fc2
    _same(pm, model, x)
    assert pm.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("where", ["model", "program"])
def test_guard_container_replaced_is_run_and_copied_as_the_new_one(where):
    """``model.block = Other()`` or ``pm.block = Other()`` (pm holds the model's own submodules):
    pm runs the new block, and so do a torch.save round trip and a deep copy (the main program read
    ``block.1``, gone: loading failed as a corrupt file; ``pm.block =`` ran the old program)."""
    import io

    torch.manual_seed(0)
    model, x = Residual(), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    (model if where == "model" else pm).block = nn.Sequential(nn.Tanh())
    want = torch.tanh(x) + x
    want = model.fc2(want) * model.gain
    buffer = io.BytesIO()
    torch.save(pm, buffer)
    buffer.seek(0)
    for program in (pm, torch.load(buffer, weights_only=False), copy.deepcopy(pm)):
        torch.testing.assert_close(program(x), want)
        assert list(program.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("data_parallel", ["replicate", "fsdp"])
def test_guard_attribute_set_on_the_program_is_followed(data_parallel):
    """``pm.use_residual = False``: the program's model reads it (it ran the old branch, silently)."""
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 2, data_parallel=data_parallel)
    eager = copy.deepcopy(model)
    pm.use_residual = eager.use_residual = False
    torch.testing.assert_close(pm(x), eager(x))


def test_guard_fsdp_container_replaced_on_the_program_is_refused():
    """``pm.block = Other()`` on a one-process FSDP program: the new block holds no pieces; refused by name."""
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(), ["cpu"] * 2, data_parallel="fsdp")
    pm.block = nn.Sequential(nn.Tanh())
    with pytest.raises(dpcompile.DpCompileError, match="'block.0'.*call dpcompile.transform again"):
        pm(torch.randn(4, 8))


def test_guard_tensor_parallel_container_replaced_is_refused_by_a_save_as_by_a_call():
    """A tensor-parallel program whose container was replaced refuses torch.save as its call does
    (the copy failed to load, called corrupt)."""
    import io

    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(), ["cpu"] * 2, tensor_parallel=True)
    pm.block = nn.Sequential(nn.Tanh())
    with pytest.raises(dpcompile.DpCompileError, match="replaced or removed"):
        torch.save(pm, io.BytesIO())


def test_guard_tensor_parallel_container_replaced_on_the_program_is_refused():
    """pm.block = Other() on a tensor-parallel program (its trace is of a private copy): refused, not the old program."""
    torch.manual_seed(0)
    pm = dpcompile.transform(Residual(), ["cpu"] * 2, tensor_parallel=True)
    pm.block = nn.Sequential(nn.Tanh())
    with pytest.raises(dpcompile.DpCompileError, match="replaced or removed"):
        pm(torch.randn(4, 8))


def _exported() -> tuple[Residual, dpcompile.ParallelModule, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(6, 8)
    return model, dpcompile.transform(model, ["cpu"] * 3, example_inputs=(x,), frontend="export"), x


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.block.register_forward_hook(lambda mod, args, out: out * 3),
        lambda m: setattr(m, "use_residual", False),
        lambda m: setattr(m, "fc2", nn.Linear(8, 8)),
        lambda m: setattr(m, "gain", nn.Parameter(torch.zeros(8))),
        lambda m: m.register_forward_hook(lambda mod, args, out: out * 3),
    ],
    ids=["container_hook", "attribute", "submodule", "parameter", "root_hook"],
)
def test_guard_export_frontend_change_after_transform_is_refused(change):
    """A program captured with torch.export cannot be traced again: a change to the model is refused, never stale."""
    model, pm, x = _exported()
    _same(pm, model, x)
    change(model)
    with pytest.raises(dpcompile.DpCompileError, match="transform again"):
        pm(x)


def test_guard_export_frontend_backward_hooks_are_refused():
    """A backward hook on the model or a container of an exported program is refused, not skipped."""
    model, pm, x = _exported()
    model.register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * 2,))
    with pytest.raises(dpcompile.DpCompileError, match="backward hooks"):
        pm(x)


def test_guard_export_frontend_eval_reaches_the_model():
    """pm.eval() on an exported program puts the model itself in eval mode too, as with fx; outputs match."""

    class Dropping(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return nn.functional.dropout(self.fc(x), 0.5, self.training)

    torch.manual_seed(0)
    model, x = Dropping(), torch.randn(6, 8)
    pm = dpcompile.transform(model, ["cpu"] * 3, example_inputs=(x,), frontend="export")
    pm.eval()
    assert not model.training
    _same(pm, model, x)


class Layered(nn.Module):
    """Blocks in a ModuleList (``encoder.layer.N``): forward indexes the list, never calls it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Residual(), Residual()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.layers[1].block.register_forward_hook(lambda mod, args, out: out * 3),
        lambda m: setattr(m.layers[1], "use_residual", False),
        lambda m: m.layers[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
    ],
    ids=["nested_container_hook", "nested_attribute", "block_pre_hook"],
)
def test_guard_changes_inside_a_module_list_are_followed(change):
    """A hook or an attribute forward reads, two levels inside a ModuleList, changes pm's output as the model's."""
    torch.manual_seed(0)
    model = Layered()
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    _same(pm, model, x)
    change(model)
    _same(pm, model, x)


@pytest.mark.parametrize("compiled", ["pm.compile", "torch.compile"])
def test_guard_changes_after_compile_are_followed(compiled):
    """After pm.compile() or torch.compile(pm): an attribute forward reads, a swapped submodule (at the root
    and inside a container) and a hook on a container are followed, as without compile."""
    model, pm, x = _pair()
    if compiled == "pm.compile":
        pm.compile(backend="eager")
        run = pm
    else:
        run = torch.compile(pm, backend="eager")
    _same(run, model, x)
    model.use_residual = False
    _same(run, model, x)
    model.fc2 = nn.Linear(8, 8)
    _same(run, model, x)
    model.block[0] = nn.Linear(8, 8)
    _same(run, model, x)
    handle = model.block.register_forward_hook(lambda module, args, out: out * 3)
    _same(run, model, x)
    handle.remove()
    _same(run, model, x)


def test_guard_recording_hook_on_a_container_before_transform_runs_at_each_call():
    """A feature-extraction hook (records, returns None) on a container forward enters, registered before
    transform: each call records the whole batch's real output, as the model's own call does."""
    torch.manual_seed(0)
    model = Residual()
    features: dict[str, torch.Tensor] = {}
    model.block.register_forward_hook(lambda module, args, out: features.__setitem__("block", out))
    pm = dpcompile.transform(model, ["cpu"] * 2)
    for _ in range(2):
        x = torch.randn(6, 8)
        pm(x)
        recorded = features["block"]
        model(x)
        assert type(recorded) is torch.Tensor
        torch.testing.assert_close(recorded, features["block"])


def test_guard_hook_computing_in_place_on_a_container_is_traced_in_once():
    """A hook that returns None but scales the output in place is part of the program, applied once."""
    torch.manual_seed(0)
    model = Residual()

    def scale(module, args, out):
        out.mul_(3)

    model.block.register_forward_hook(scale)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    _same(pm, model, torch.randn(6, 8))


def _passthrough(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


def _scaled_by(module, h):
    return h * module.helper_scale  # read by a function the forward calls, as transformers' attention functions do


class Decorated(nn.Module):
    """A decorated forward (transformers wraps every forward) that reads an attribute through a helper function."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.helper_scale = 1.0

    @_passthrough
    def forward(self, x):
        return _scaled_by(self, self.fc(x))


def test_guard_attribute_read_behind_a_decorator_and_in_a_helper_is_followed():
    torch.manual_seed(0)
    model = nn.Sequential(Decorated(), Decorated())
    pm = dpcompile.transform(model, ["cpu"] * 2)
    x = torch.randn(6, 8)
    model[1].helper_scale = 2.0
    _same(pm, model, x)
