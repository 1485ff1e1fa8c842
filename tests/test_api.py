"""transform's arguments: what no frontend can capture, and examples that do not fit, are refused
up front with the way out (never a NameError from generated code, never silently ignored)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dpcompile
from tests.models import MLP


@dataclasses.dataclass
class Cfg:
    scale: float = 2.0


class TensorDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, bias=torch.ones(4)):  # noqa: B008 - the case under test
        return self.fc(x) + bias


class Varargs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *xs):
        return sum(self.fc(x) for x in xs)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **kw):
        return self.fc(x) * kw.get("scale", 1.0)


def test_transform_refuses_a_tensor_default_saying_how():
    """forward(self, x, bias=torch.ones(4)): a TraceError naming the argument and the way out."""
    with pytest.raises(dpcompile.TraceError, match=r"argument 'bias' has a tensor as its default.*default it to None"):
        dpcompile.transform(TensorDefault(), ["cpu"] * 2)


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_transform_runs_a_varargs_forward_each_value_split(tensor_parallel):
    """forward(self, *xs), as nn.DataParallel runs it: one argument per example value (xs_0, xs_1),
    each split on its batch; a call with another count is refused by Python's binding, not run short."""
    model, a, b = Varargs(), torch.randn(6, 4), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(a, b))
    torch.testing.assert_close(pm(a, b), model(a, b))
    if not tensor_parallel:
        assert pm.input_dims == {"xs_0": 0, "xs_1": 0}
    with pytest.raises(TypeError, match="positional arguments"):
        pm(a, b, a)


def test_transform_runs_a_forward_with_keyword_arguments():
    """forward(self, x, **kw): calls with and without keywords equal eager."""
    model, x = Keywords(), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x, scale=2.0), model(x, scale=2.0))


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_transform_refuses_examples_that_do_not_fit(tensor_parallel):
    """example_inputs= shaped (6, 5) for a Linear(8, ...): ValueError naming the op, not ignored."""
    with pytest.raises(ValueError, match=r"example_inputs= do not fit the model: fc1"):
        dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel=tensor_parallel, example_inputs=(torch.randn(6, 5),))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.fc(x) + y


@pytest.mark.parametrize(
    ("model", "example_inputs", "example_kwargs", "message"),
    [
        (nn.Linear(4, 4), (torch.randn(6, 4), torch.randn(6, 4)), None, r"do not fit Linear.forward\(input: torch.Tensor\).*too many positional arguments"),
        (TwoInputs(), (torch.randn(6, 4),), None, r"do not fit TwoInputs.forward\(x, y\): missing a required argument: 'y'"),
        (nn.Linear(4, 4), None, {"nope": torch.randn(6, 4)}, r"example_kwargs= name 'nope', which Linear.forward.* does not take"),
        (TwoInputs(), (torch.randn(6, 4),), {"x": torch.randn(6, 4)}, r"multiple values for argument 'x'"),
        (nn.Linear(4, 4), {"input": torch.randn(6, 4)}, None, r"example_inputs= takes the positional examples as a tuple, got a dict.*example_kwargs="),
        (nn.Linear(4, 4), None, [torch.randn(6, 4)], r"example_kwargs= must be a dict"),
    ],
    ids=["too_many", "too_few", "unknown_keyword", "given_twice", "dict_as_inputs", "list_as_kwargs"],
)
def test_transform_refuses_examples_forward_cannot_take(model, example_inputs, example_kwargs, message):
    """Examples that do not bind to forward's signature: an ExampleError (a ValueError and a
    TypeError) at transform, in Python's words, before anything is traced."""
    for error in (ValueError, TypeError, dpcompile.DpCompileError):
        with pytest.raises(error, match=message):
            dpcompile.transform(model, ["cpu"] * 2, example_inputs=example_inputs, example_kwargs=example_kwargs)


@pytest.mark.parametrize(
    ("example", "message"),
    [
        (torch.randint(0, 3, (6, 8)), r"fc1 \(Linear\) refuses them \(expected torch.float32 input, the dtype of its weight, got torch.int64\)"),
        ("hello", r"must be Tensor, not str"),
        (torch.randn(6, 8).double(), r"expected torch.float32 input.*got torch.float64"),
    ],
    ids=["int", "str", "float64"],
)
def test_transform_refuses_examples_of_the_wrong_type(example, message):
    """An example of the wrong dtype or type is refused at transform (fake tensors do not check a
    Linear's dtype), not logged and ignored."""
    with pytest.raises(ValueError, match=message):
        dpcompile.transform(MLP(), ["cpu"] * 2, example_inputs=(example,))


def test_transform_refuses_examples_that_do_not_fit_the_export_frontend():
    """frontend='export' with a misshapen example: the same ValueError as fx's, not a TraceError."""
    with pytest.raises(ValueError, match=r"example_inputs= do not fit Linear: .*same reduction dim"):
        dpcompile.transform(nn.Linear(4, 4), ["cpu"] * 2, frontend="export", example_inputs=(torch.randn(6, 5),))


class CfgDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, cfg=Cfg()):  # noqa: B008 - the case under test
        return self.fc(x) * cfg.scale


class FunctionDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, act=torch.relu):
        return act(self.fc(x))


@pytest.mark.parametrize("model", [CfgDefault(), FunctionDefault()], ids=["dataclass", "function"])
def test_transform_refuses_a_default_code_cannot_spell(model):
    """A default generated code cannot write (a dataclass instance, a function): a TraceError naming
    the argument and the way out, not a NameError from fx's code generation."""
    name = "cfg" if isinstance(model, CfgDefault) else "act"
    with pytest.raises(dpcompile.TraceError, match=rf"argument '{name}' defaults to .*default it to None"):
        dpcompile.transform(model, ["cpu"] * 2)


def test_transform_keeps_defaults_code_can_spell():
    """Floats, strings, tuples, dicts and dtypes as defaults trace and run as eager."""

    class Spelled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale=2.0, act="relu", dims=(0, 1), opts={"s": 3.0}, dtype=torch.float32):  # noqa: B006
            y = self.fc(x).to(dtype) * scale * opts["s"]
            return (torch.relu(y) if act == "relu" else torch.tanh(y)).sum(dims[1])

    model, x = Spelled(), torch.randn(6, 4)
    pm = dpcompile.transform(model, ["cpu"] * 2)
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x, 0.5, act="tanh"), model(x, 0.5, act="tanh"))


def test_transform_checks_leaf_modules_and_plan_keys():
    """leaf_modules=Block (one class) works as [Block]; a plan keyed by an int names the fix."""
    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, leaf_modules=nn.Linear)
    x = torch.randn(6, 8)
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(ValueError, match=r"plan key 0 is a int; keys are module paths"):
        dpcompile.transform(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), ["cpu"] * 2, tensor_parallel={0: "column"})
    with pytest.raises(ValueError, match=r"leaf_modules= must be a list of nn.Module subclasses"):
        dpcompile.transform(model, ["cpu"] * 2, leaf_modules=3)


BAD_ARGUMENTS = {  # keyword -> (transform's keywords, what the message names)
    "devices": ({"devices": []}, "devices"),
    "device spec": ({"devices": ["nope"]}, "device spec"),
    "tensor_parallel": ({"tensor_parallel": "yes"}, "tensor_parallel="),
    "plan style": ({"tensor_parallel": {"fc1": "diagonal"}}, "tensor_parallel plan"),
    "frontend": ({"frontend": "jit"}, "frontend="),
    "batch_dim": ({"batch_dim": -1}, "batch_dim="),
    "batch_dim of the examples": ({"batch_dim": 2, "example_inputs": (torch.randn(4, 8),)}, "batch_dim=2"),
    "output_device": ({"output_device": "nope"}, "output_device="),
    "leaf_modules": ({"leaf_modules": [int]}, "leaf_modules"),
    "pipeline": ({"pipeline": 0}, "pipeline=0"),
    "micro_batches": ({"micro_batches": 2}, "micro_batches="),
    "schedule": ({"pipeline": 2, "schedule": "zigzag"}, "schedule="),
    "data_parallel": ({"data_parallel": "zero"}, "data_parallel="),
    "memory_per_device": ({"memory_per_device": "lots"}, "memory_per_device="),
    "mesh": ({"mesh": {"xx": 2}}, "mesh="),
    "sequence_parallel": ({"sequence_parallel": "yes"}, "sequence_parallel="),
    "activation_checkpointing regions": ({"activation_checkpointing": {"regions": 5}}, "activation_checkpointing="),
    "plan": ({"plan": "best"}, "plan="),
    "progress": ({"progress": "yes"}, "progress="),
    "context_parallel": ({"context_parallel": 5}, "context_parallel="),
    "exact_random an int": ({"exact_random": 1}, "exact_random="),  # was read as True
    "sequence_parallel an int": ({"sequence_parallel": 1, "tensor_parallel": True}, "sequence_parallel="),
    "dynamic_dims naming no argument": ({"dynamic_dims": {"nope": [1]}}, "dynamic_dims="),  # was accepted
    # a tensor-parallel program transformed again: was accepted, with a state_dict of two biases
    "model a ParallelModule": ({"model": lambda: dpcompile.transform(MLP(), ["cpu"] * 2, tensor_parallel=True)},
                               "already a dpcompile.ParallelModule"),
    # was a TraceError suggesting example_inputs=, which fails too
    "model a torch.compile wrapper": ({"model": lambda: torch.compile(MLP(), backend="eager")}, "torch.compile wrapper"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_a_dpcompile_error_naming_it_and_changes_nothing(case):
    """Every bad argument is a DpCompileError (ArgumentError, still a ValueError as API.md says) whose
    message names it (was a bare ValueError, or a TypeError from deep inside for some), and the model
    is left as it was."""
    options, named = BAD_ARGUMENTS[case]
    options = dict(options)
    devices = options.pop("devices", ["cpu"] * 2)
    model = options.pop("model", MLP)()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpcompile.ArgumentError) as error:
        dpcompile.transform(model, devices, **options)
    assert isinstance(error.value, dpcompile.DpCompileError) and isinstance(error.value, ValueError)
    assert named in str(error.value)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


BAD_CALLS = {  # the public function called with a model where pm is due, or a value of the wrong kind
    "save_checkpoint": lambda tmp: dpcompile.save_checkpoint(MLP(), tmp / "ckpt"),  # was a TypeError from super()
    "load_checkpoint": lambda tmp: dpcompile.load_checkpoint(MLP(), tmp / "ckpt"),
    "export": lambda tmp: dpcompile.export(MLP(), tmp / "folder"),
    "draw": lambda tmp: dpcompile.draw(MLP(), tmp / "graph.svg"),  # was an AttributeError
    "verify": lambda tmp: dpcompile.verify(torch.randn(2), MLP(), torch.randn(2, 8)),
    "local_batch": lambda tmp: dpcompile.local_batch(torch.randn(4, 2), ["cpu", "cpu"]),  # was an AttributeError
    "register_batch_rule target": lambda tmp: dpcompile.register_batch_rule(3, "elementwise"),
    "register_batch_rule rule": lambda tmp: dpcompile.register_batch_rule(torch.sin, "sideways"),
    "export path": lambda tmp: dpcompile.export(dpcompile.transform(MLP(), ["cpu"] * 2), None),  # was pathlib's TypeError
    "draw path": lambda tmp: dpcompile.draw(dpcompile.transform(MLP(), ["cpu"] * 2), None),  # was pathlib's TypeError
    "load path": lambda tmp: dpcompile.load(None),  # was a bare ValueError
    "verify pm first": lambda tmp: dpcompile.verify(MLP(), dpcompile.transform(MLP(), ["cpu"] * 2), torch.randn(4, 8)),
    "verify inputs the model refuses": lambda tmp: dpcompile.verify(  # was torch's RuntimeError from the eager run
        dpcompile.transform(MLP(), ["cpu"] * 2), MLP(), torch.randn(4, 9)),
    "verify fake_devices": lambda tmp: dpcompile.verify(  # said "devices is empty", not naming fake_devices=
        dpcompile.transform(MLP(), ["cpu"] * 2), MLP(), torch.randn(4, 8), fake_devices=0),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_the_other_public_functions_refuse_bad_arguments_by_name(case, tmp_path):
    """save_checkpoint, load_checkpoint, export, draw, verify, local_batch and register_batch_rule given
    a model where pm is due (or a value of the wrong kind) raise ArgumentError, a DpCompileError that
    is a ValueError and a TypeError too, naming the function's argument; nothing is written."""
    with pytest.raises(dpcompile.ArgumentError) as error:
        BAD_CALLS[case](tmp_path)
    assert isinstance(error.value, (ValueError, TypeError)) and str(error.value)
    assert not list(tmp_path.iterdir())


def test_every_error_kind_the_docs_name_is_a_dpcompile_error_of_the_package():
    """docs/limitations.md ("Errors") names the kinds a caller may catch as ``dpcompile.<name>``."""
    import re
    from pathlib import Path

    errors = Path(__file__).parent.parent / "docs" / "limitations.md"
    section = errors.read_text().split("## Errors", 1)[1]
    names = set(re.findall(r"`([A-Z][A-Za-z]+Error|InputMismatch|ModelChanged)`", section)) - {"ValueError", "TypeError"}
    assert {"ArgumentError", "ExampleError", "TraceError", "InputMismatch", "CheckpointError"} <= names
    for name in sorted(names):
        kind = getattr(dpcompile, name)
        assert issubclass(kind, dpcompile.DpCompileError) and name in dpcompile.__all__, name
    assert issubclass(dpcompile.ArgumentError, ValueError) and issubclass(dpcompile.ArgumentError, TypeError)


CALL_LAYOUTS = {
    "dp": (2, {}),
    "tp": (2, {"tensor_parallel": True}),
    "pp": (2, {"pipeline": 2, "micro_batches": 2}),
    "dp_x_tp": (4, {"mesh": {"dp": 2, "tp": 2}}),
}


@pytest.mark.parametrize("layout", list(CALL_LAYOUTS))
def test_a_call_the_model_refuses_is_an_input_mismatch_of_the_kind_eager_raises_and_changes_nothing(layout):
    """A None, a list, a wrong dtype or width, a missing or extra argument: torch's error from deep
    inside the program (for a tensor-parallel program an AttributeError from the input's copy) is raised
    as dpcompile.InputMismatch, still of the kind eager raises for the same call, naming the call's
    arguments; the program and the model's state are unchanged."""
    n, options = CALL_LAYOUTS[layout]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    pm = dpcompile.transform(model, ["cpu"] * n, **options)
    expected, state = pm(x).detach(), {k: v.clone() for k, v in pm.state_dict().items()}
    for bad in [(None,), ([x],), (x.double(),), (torch.randn(4, 9),), (), (x, x)]:
        with pytest.raises(Exception) as eager:
            model(*bad)
        with pytest.raises(dpcompile.InputMismatch, match="The call gave") as error:
            pm(*bad)
        assert isinstance(error.value, type(eager.value)), (bad, error.value)
    torch.testing.assert_close(pm(x), expected, rtol=0, atol=0)
    assert all(torch.equal(v, state[k]) for k, v in pm.state_dict().items())


def test_a_device_out_of_memory_inside_a_call_stays_torchs_error():
    """Running out of device memory is not the arguments' fault: pm(...) leaves torch's OutOfMemoryError as it is
    instead of an InputMismatch telling the user to change the arguments."""

    class OutOfMemory(nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pm = dpcompile.transform(nn.Sequential(nn.Linear(8, 8), OutOfMemory()), ["cpu"] * 2, leaf_modules=[OutOfMemory])
    with pytest.raises(torch.OutOfMemoryError) as error:
        pm(torch.randn(4, 8))
    assert not isinstance(error.value, dpcompile.InputMismatch)


def test_load_refuses_an_expected_hash_that_is_no_sha256_by_name(tmp_path):
    """load(path, expected_hash="abc") is an ArgumentError (was a bare ValueError) naming expected_hash."""
    dpcompile.export(dpcompile.transform(MLP(), ["cpu"] * 2), tmp_path / "folder")
    with pytest.raises(dpcompile.ArgumentError, match="expected_hash must be a sha256"):
        dpcompile.load(tmp_path / "folder", expected_hash="abc")


def test_measure_refuses_inputs_the_program_cannot_take_as_an_input_mismatch_and_changes_nothing():
    """measure(pm, x) with a wrong width or a None: InputMismatch of torch's kind (was a bare RuntimeError /
    TypeError from fx's interpreter), gradients and state as they were."""
    pm = dpcompile.transform(MLP(), ["cpu"] * 2)
    state = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(dpcompile.InputMismatch, match="The call gave x: float32 tensor of shape \\(4, 9\\)") as error:
        dpcompile.measure(pm, torch.randn(4, 9))
    assert isinstance(error.value, RuntimeError)
    with pytest.raises(dpcompile.InputMismatch) as error:
        dpcompile.measure(pm, None)
    assert isinstance(error.value, TypeError)
    assert all(p.grad is None for p in pm.parameters())
    assert all(torch.equal(v, state[k]) for k, v in pm.state_dict().items())


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["data_parallel", "tensor_parallel"])
def test_load_state_dict_refusals_are_dpcompile_errors_and_load_nothing(tensor_parallel):
    """pm.load_state_dict of another model's dict, of a wrong shape, or of None: StateDictError (a
    RuntimeError too, as torch's) or ArgumentError (a TypeError too), and nothing is loaded."""
    model = MLP()
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=tensor_parallel)
    state = {k: v.clone() for k, v in pm.state_dict().items()}
    wrong_shape = {**state, "fc1.weight": torch.randn(3, 3)}
    for bad, kind in [(MLP(d_in=4).state_dict(), RuntimeError), (wrong_shape, RuntimeError), (None, TypeError)]:
        with pytest.raises(dpcompile.DpCompileError) as error:
            pm.load_state_dict(bad)
        assert isinstance(error.value, kind), error.value
        assert "nothing was loaded" in str(error.value) or "load_state_dict expected a dict" in str(error.value)
    assert all(torch.equal(v, state[k]) for k, v in pm.state_dict().items())
