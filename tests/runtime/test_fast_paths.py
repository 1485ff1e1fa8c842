"""The runtime's fast paths give what the general paths give."""

import torch
from torch import nn

from dpcompile import runtime
from dpcompile.runtime.comm import as_devices
from dpcompile.runtime.replicate import _first_tensor_device


def test_scatter_of_a_tensor_on_virtual_devices_gives_views():
    """A tensor split over virtual devices comes back as tensor_split's views, gradients intact."""
    x = torch.randn(7, 3, requires_grad=True)
    chunks = runtime.scatter(x, ["cpu"] * 3, 0)
    assert [c.shape[0] for c in chunks] == [3, 2, 2]
    assert all(c._base is x for c in chunks)
    torch.cat(chunks).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(7, 3))


def test_scatter_and_gather_of_structures_unchanged():
    """Structures still split leaf by leaf and gather back (dicts, tuples, None, scalars)."""
    value = {"a": torch.arange(6.0).view(3, 2), "b": (None, 5, torch.ones(3))}
    parts = runtime.scatter(value, ["cpu", "cpu"], 0)
    assert parts[0]["b"][:2] == (None, 5) and parts[1]["a"].shape == (1, 2)
    back = runtime.gather(list(parts), 0, "cpu")
    torch.testing.assert_close(back["a"], value["a"])
    torch.testing.assert_close(back["b"][2], value["b"][2])


def test_gather_of_tensors_matches_cat():
    """The tensor fast path of gather is torch.cat on the output device."""
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    torch.testing.assert_close(runtime.gather([a, b], 0, "cpu"), torch.cat([a, b]))
    torch.testing.assert_close(runtime.gather([a, b], 0, torch.device("cpu")), torch.cat([a, b]))


def test_device_literals_parse_once_to_the_same_devices():
    """Device strings and torch.device objects parse to tuples of devices, each literal once."""
    first = as_devices(["cpu", "cpu"])
    assert first == (torch.device("cpu"), torch.device("cpu"))
    assert as_devices(["cpu", "cpu"]) is first
    assert as_devices([torch.device("cpu")]) == (torch.device("cpu"),)


def test_broadcast_on_virtual_devices_returns_the_tensor_itself():
    """No copies where every device is the tensor's own."""
    w = torch.randn(3)
    assert all(c is w for c in runtime.broadcast(w, ["cpu"] * 3))


def test_first_tensor_device_follows_a_replaced_parameter():
    """The cached 'first tensor' of a module is looked up again once it is replaced."""
    lin = nn.Linear(2, 2)
    assert _first_tensor_device({"lin": lin}) == torch.device("cpu")
    lin.weight = nn.Parameter(torch.randn(2, 2, dtype=torch.float64))
    assert _first_tensor_device({"lin": lin}) == torch.device("cpu")
    seq = nn.Sequential()
    assert _first_tensor_device({"seq": seq}) is None


def test_virtual_replicate_roots_alias_the_modules():
    """On virtual devices every replica root holds the original modules, readable as attributes
    (a module with children through a view whose children are the originals)."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    roots = runtime.replicate({"seq": seq}, ["cpu", "cpu"])
    assert len(roots) == 2 and all(runtime.module_of(r.seq) is seq and getattr(r.seq, "0") is seq[0] for r in roots)
    assert getattr(roots[0], "seq.0") is seq[0]


def test_module_view_reads_and_calls_as_the_module():
    """A view's children are the module's; attributes, calls, indexing and hooks are the module's own."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    seen = []
    seq.register_forward_hook(lambda module, args, out: seen.append(module))
    (root,) = runtime.replicate({"seq": seq}, ["cpu"])
    view = root.seq
    assert type(view) is runtime.ModuleView and runtime.module_of(view) is seq
    assert getattr(view, "0") is seq[0] and runtime.module_of(getattr(view, "1")) is seq[1]
    assert view[0] is seq[0] and len(view) == 2 and list(view) == list(seq)
    seq.eval()
    assert view.training is False and view.state_dict().keys() == seq.state_dict().keys()
    x = torch.randn(3, 2)
    torch.testing.assert_close(view(x), seq(x))
    assert seen == [seq, seq]


def test_module_view_follows_a_replaced_or_added_child():
    """A kept view is made again once a module is replaced or added anywhere under it."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    first = runtime.replicate({"seq": seq}, ["cpu"])[0].seq
    assert runtime.replicate({"seq": seq}, ["cpu"])[0].seq is first  # nothing changed: the same view
    seq[0] = nn.Linear(2, 2)
    assert getattr(runtime.replicate({"seq": seq}, ["cpu"])[0].seq, "0") is seq[0]
    seq[1].add_module("extra", nn.ReLU())
    inner = getattr(runtime.replicate({"seq": seq}, ["cpu"])[0].seq, "1")
    assert inner.extra is seq[1].extra


def test_module_view_keeps_no_module_alive():
    """The views kept between forwards hold their module weakly: a dropped model is freed."""
    import gc
    import weakref

    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    runtime.replicate({"seq": seq}, ["cpu", "cpu"], include_source=True)
    ref = weakref.ref(seq)
    del seq
    gc.collect()
    assert ref() is None


def test_replicate_include_source_gives_device_0_the_modules_themselves():
    """With include_source the first root holds the originals, even where the others are copies."""
    lin = nn.Linear(2, 2)
    r0, r1 = runtime.replicate({"lin": lin}, ["cpu", "cpu"], copy=True, include_source=True)
    assert r0.lin is lin and r1.lin is not lin and r1.lin.weight is not lin.weight
    torch.testing.assert_close(r1.lin.weight, lin.weight)
