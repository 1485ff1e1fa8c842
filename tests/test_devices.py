"""Device lists: the accepted forms and the errors for the rest."""

import pytest
import torch

from dpcompile.devices import parse_devices


def test_parse_devices_accepts_repeated_cpu_as_virtual_devices():
    """['cpu'] * 3 is three slots on one physical device."""
    devices = parse_devices(["cpu"] * 3)
    assert devices.strings() == ["cpu", "cpu", "cpu"]
    assert devices.labels() == ["cpu#0", "cpu#1", "cpu#2"]
    assert devices.shares_memory_with_primary(2)


def test_parse_devices_int_without_cuda_gives_virtual_cpus():
    """An int n means n virtual CPU devices on a machine without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert parse_devices(2).strings() == ["cpu", "cpu"]


def test_parse_devices_accepts_torch_devices_and_strings():
    """torch.device objects and strings mix freely."""
    assert parse_devices([torch.device("cpu"), "cpu"]).strings() == ["cpu", "cpu"]


def test_parse_devices_fake_cuda_without_check():
    """Fake CUDA layouts can be described on a CPU machine when availability is not checked."""
    devices = parse_devices([0, "cuda:3"], check_available=False)
    assert devices.strings() == ["cuda:0", "cuda:3"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ([], "empty"),
        (0, "positive"),
        (-2, "positive"),
        (["gpu:0"], "cannot parse"),
        ([object()], "cannot parse"),
        ([-1], "negative"),
        ("cpu", "single device"),
        (True, "bool"),
    ],
)
def test_parse_devices_rejects_bad_specs_with_what_is_accepted(spec, words):
    """Bad specs raise ValueError naming the problem and the accepted forms."""
    with pytest.raises(ValueError, match=words) as info:
        parse_devices(spec)
    assert "expected" in str(info.value) or "pass a list" in str(info.value)


def test_parse_devices_rejects_cuda_index_beyond_device_count():
    """cuda:N past torch.cuda.device_count() is refused with the count in the message."""
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"beyond the {count} CUDA device"):
        parse_devices([f"cuda:{count}"])


def test_parse_devices_single_unparsable_string_says_it_cannot_be_parsed():
    """devices='gpu:0' is refused as unparsable, not with advice to pass ['gpu:0']."""
    with pytest.raises(ValueError, match="cannot parse device spec 'gpu:0'") as info:
        parse_devices("gpu:0")
    assert "['gpu:0']" not in str(info.value)


def test_parse_devices_cuda_without_gpus_names_no_index_range():
    """Without CUDA, a cuda device is refused without the empty range 'indices 0..-1'."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="repeated 'cpu' entries") as info:
        parse_devices(["cuda:0"])
    assert "0..-1" not in str(info.value)


@pytest.mark.parametrize(
    "devices, options, words",
    [
        (["meta", "meta"], {}, "holds shapes, not data"),  # was accepted, and moved the model's weights to meta
        (["cpu", "cpu"], {"output_device": "meta"}, "holds shapes, not data"),
        ({"cpu": 2}, {}, "is a mapping"),  # was read as its keys: one device
        (["mps", "mps"], {}, "cannot be used here"),  # was a RuntimeError from model.to
    ],
    ids=["meta", "output_device_meta", "mapping", "unavailable_type"],
)
def test_transform_refuses_devices_that_cannot_hold_the_program_and_leaves_the_model(devices, options, words):
    """A device list that names no real device is an ArgumentError before the model is touched."""
    if devices == ["mps", "mps"] and torch.backends.mps.is_available():
        pytest.skip("this machine has mps")
    import dpcompile

    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpcompile.ArgumentError, match=words):
        dpcompile.transform(model, devices, **options)
    assert all(v.device.type == "cpu" and torch.equal(v, before[k]) for k, v in model.state_dict().items())
