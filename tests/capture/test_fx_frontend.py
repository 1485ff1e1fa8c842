"""The fx frontend on code people have: optional and flag arguments, errors that help."""

import os

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile.capture import capture_fx
from dpcompile.capture.errors import _is_library_file
from tests.thirdparty import import_or_skip


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[1] != 4:  # a branch on a shape
            x = x[:, :4]
        return self.fc(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ShapeBranch()

    def forward(self, x):
        return self.inner(x) * 2


class OwnShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.size(0) > 1:
            return self.fc(x)
        return x


class FlagAndMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None, causal: bool = False):
        if mask is not None or causal:
            x = x * (mask if mask is not None else 0.5)
        return self.fc(x)


def test_fx_error_names_shape_branch_file_line_and_export_frontend():
    """A shape branch is named as such, with the file:line and the export frontend as a way out."""
    with pytest.raises(dpcompile.TraceError) as info:
        dpcompile.transform(Outer(), ["cpu"] * 2, frontend="fx")
    message = str(info.value)
    assert "test_fx_frontend.py:" in message and "if x.shape[1] != 4" in message
    assert "branches on a shape" in message and "tensor value" not in message
    assert "example_inputs=" in message and "export frontend" in message
    assert "leaf_modules=[ShapeBranch]" in message


def test_fx_error_never_suggests_root_or_placeholder_as_leaf():
    """Where the root's own code fails, no leaf is offered (never the root, never '[...]')."""
    with pytest.raises(dpcompile.TraceError) as info:
        dpcompile.transform(OwnShapeBranch(), ["cpu"] * 2, frontend="fx")
    message = str(info.value)
    assert "leaf_modules=[OwnShapeBranch]" not in message and "[...]" not in message
    assert "example_inputs=" in message


def test_fx_error_file_line_in_any_package():
    """torch's directory prefix does not swallow torchvision's (a trailing separator)."""
    torch_dir = os.path.dirname(torch.__file__)
    assert _is_library_file(os.path.join(torch_dir, "nn", "modules", "linear.py"))
    assert not _is_library_file(torch_dir + "vision" + os.sep + "models" + os.sep + "resnet.py")


def test_fx_specialises_flag_with_optional_none():
    """`if mask is not None or causal`: the flag is fixed from its default, calls with and without a mask match eager."""
    model = FlagAndMask()
    gm, flags = capture_fx(model)
    assert flags == {"causal": False}
    pm = dpcompile.transform(model, ["cpu"] * 3)
    x, mask = torch.randn(7, 4), torch.randn(7, 4)
    torch.testing.assert_close(pm(x), model(x))
    torch.testing.assert_close(pm(x, mask), model(x, mask))
    torch.testing.assert_close(pm(x, causal=True), model(x, causal=True))


def test_fx_timm_vit_transforms_and_runs_first_call():
    """timm ViT (`if attn_mask is not None or is_causal`) transforms with fx and matches eager, uneven batch."""
    timm = import_or_skip("timm")
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10, depth=2
    ).eval()
    pm = dpcompile.transform(model, ["cpu"] * 4, frontend="fx")
    x = torch.randn(7, 3, 32, 32)
    torch.testing.assert_close(pm(x), model(x), atol=1e-5, rtol=1e-5)


def _wrapped(forward):
    import functools

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):  # as transformers 5.x wraps every forward
        return forward(self, *args, **kwargs)

    return wrapper


class WrappedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @_wrapped
    def forward(self, x, mask=None, causal: bool = False):
        return self.fc(x if mask is None and not causal else x * 2)


def test_fx_follows_wrapped_to_the_real_signature():
    """Flags and optional arguments are read behind a decorator (``__wrapped__``)."""
    from dpcompile.capture import flag_arguments, optional_arguments

    model = WrappedForward()
    assert flag_arguments(model, example_kwargs={"causal": True}) == {"causal": True}
    assert optional_arguments(model) == frozenset({"mask"})


class DictInputWithAFlag(nn.Module):
    """A dict of tensors (torch.export refuses it) and a flag forward branches on."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, batch, relu=True):
        h = self.up(batch["x"] + 2 * batch["y"][0])
        return self.down(h.relu() if relu else h)


@pytest.mark.parametrize("layout", [{"tensor_parallel": True}, {"mesh": {"dp": 2, "tp": 2}}])
def test_a_flag_and_a_dict_input_under_tensor_parallel_take_fx_where_export_refuses_the_dict(layout):
    """Under ``frontend="auto"`` a flag sends tensor parallelism to torch.export, which refused the dict
    argument (TraceError, though fx had traced it): fx's program, as ``frontend="fx"`` builds, with
    the flag's other value served per call."""
    torch.manual_seed(0)
    model = DictInputWithAFlag()

    def batch(n):
        return {"x": torch.randn(n, 8), "y": [torch.randn(n, 8)]}

    pm = dpcompile.transform(model, ["cpu"] * 4, example_inputs=(batch(6),), **layout)
    for relu, inputs in ((True, batch(5)), (False, batch(3))):
        torch.testing.assert_close(pm(inputs, relu=relu), model(inputs, relu=relu))


def test_fx_error_names_the_transformers_decorator_it_cannot_trace():
    """transformers 5.x wraps forward as wrapped_func(*args, **kwargs): the fx error names that decorator, not fx's code error."""
    transformers = import_or_skip("transformers")
    config = transformers.FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       new_decoder_architecture=False, multi_query=True, alibi=False)
    model = transformers.FalconForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpcompile.TraceError, match=r"wrapped by 'deprecate_kwarg' as wrapper\(\*args, \*\*kwargs\)"):
        dpcompile.transform(model, ["cpu"] * 2, frontend="fx")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _hides_its_arguments(forward):
    def wrapper(self, *args, **kwargs):  # no functools.wraps: forward's names are gone
        return forward(self, *args, **kwargs)

    return wrapper


class _WrappedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @_hides_its_arguments
    def forward(self, x):
        return self.fc(x).relu()


@pytest.mark.parametrize("examples", [None, (torch.randn(4, 4),)], ids=["fx", "export"])
def test_a_decorator_without_wraps_is_named_with_the_fix(examples):
    """forward as ``wrapper(self, *args, **kwargs)`` without functools.wraps: both frontends say
    the wrapper hides forward's arguments and that @functools.wraps is the fix (the export
    frontend used to say forward 'takes 0 positional arguments')."""
    model = _WrappedForward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fix = r"decorate 'wrapper' with @functools\.wraps\(forward\)" if examples is None else r"as \*args.*@functools\.wraps"
    with pytest.raises(dpcompile.TraceError, match=fix):
        dpcompile.transform(model, ["cpu"] * 2, example_inputs=examples)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
