"""hoist_flatten_parameters: one flatten per RNN per replica, at the head of forward."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpcompile
from dpcompile import runtime
from dpcompile.capture import capture
from passes import find_flatten_sites, hoist_flatten_parameters
from tests.helpers import check_against_eager


class Encoder(nn.Module):
    def __init__(self, kind=nn.LSTM, **options):
        super().__init__()
        self.rnn = kind(4, 6, **options)

    def forward(self, x):
        self.rnn.flatten_parameters()
        out = self.rnn(x)[0]
        self.rnn.flatten_parameters()  # a duplicate, as users write them
        return out


class Stack(nn.Module):
    """A nested encoder that flattens itself, a GRU never flattened, an RNN flattened in a loop."""

    def __init__(self):
        super().__init__()
        self.enc = Encoder(nn.LSTM, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(12, 5, batch_first=False)
        self.plain = nn.RNN(5, 3)

    def forward(self, x):
        h = self.enc(x)
        for _ in range(2):
            self.plain.flatten_parameters()
        return self.plain(self.gru(h)[0])[0]


def _flatten_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime.flatten_parameters]


def test_find_flatten_sites_lists_calls_and_every_rnn_in_order():
    """The finder sees every recorded call and every RNN, flattened or not."""
    sites = find_flatten_sites(capture(Stack()))
    assert len(sites.calls) == 4
    assert sites.rnn_paths == ["enc.rnn", "plain", "gru"]  # by first appearance in forward


def test_hoist_puts_one_call_per_rnn_right_after_placeholders():
    """Duplicates go; every RNN gets exactly one call, before any computation."""
    gm = capture(Stack())
    result = hoist_flatten_parameters(gm)
    assert result.modified
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    head = nodes[:6]
    assert [(n.op, n.target if n.op == "get_attr" else n.target.__name__) for n in head] == [
        ("get_attr", "enc.rnn"), ("call_function", "flatten_parameters"),
        ("get_attr", "plain"), ("call_function", "flatten_parameters"),
        ("get_attr", "gru"), ("call_function", "flatten_parameters"),
    ]
    assert len(_flatten_nodes(gm)) == 3
    assert all(n.meta["dpcompile_pass"] == "hoist_flatten_parameters" for n in head)


def test_hoist_is_idempotent():
    """A second run changes nothing and says so."""
    gm = capture(Stack())
    hoist_flatten_parameters(gm)
    gm.recompile()
    code = gm.code
    again = hoist_flatten_parameters(gm)
    gm.recompile()
    assert not again.modified and gm.code == code


def test_hoist_is_a_no_op_without_rnns():
    """A model without RNNs is left untouched, modified=False."""
    gm = capture(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    before = [(n.op, n.target) for n in gm.graph.nodes]
    assert not hoist_flatten_parameters(gm).modified
    assert [(n.op, n.target) for n in gm.graph.nodes] == before


@pytest.mark.parametrize("n_devices", [1, 2, 3, 4])
def test_each_replica_gets_one_flatten_per_rnn_before_computation(n_devices):
    """After replication: RNNs × devices flatten calls, all before the first RNN runs."""
    pm = dpcompile.transform(Stack(), ["cpu"] * n_devices)
    calls = _flatten_nodes(pm)
    assert len(calls) == 3 * n_devices
    order = list(pm.graph.nodes)
    first_rnn = min(order.index(n) for n in order if n.op in ("call_module", "call_method"))
    assert all(order.index(c) < first_rnn for c in calls)


def test_real_replicas_flatten_their_own_rnn():
    """With real replicas, device k's flatten call names replica k's module."""
    pm = dpcompile.transform(Stack(), ["cpu"] * 3, copy_replicas=True)
    code = pm.code
    assert "dpcompile_runtime_flatten_parameters(rnn_dev2)" in code
    assert "enc_dev2 = replica_dev2.enc" in code
    calls = _flatten_nodes(pm)
    assert len(calls) == 9


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_rnn_models_match_eager(kind, n_devices):
    """Forward and backward of bidirectional multi-layer RNNs equal eager, on 1-4 devices."""
    check_against_eager(
        lambda: Encoder(kind, num_layers=2, bidirectional=True), ["cpu"] * n_devices, torch.randn(5, 7, 4)
    )


def test_nested_rnn_stack_matches_eager_with_real_replicas():
    """The replicated path (weights in one buffer per replica) matches eager too."""
    check_against_eager(Stack, ["cpu"] * 3, torch.randn(6, 5, 4), transform_kwargs={"copy_replicas": True})


def test_replica_rnn_weights_are_one_buffer_during_forward():
    """Inside forward each replica's RNN weights are views into one buffer, in order."""
    seen = []
    original = runtime.flatten_parameters

    model = Encoder(nn.LSTM, num_layers=2)
    pm = dpcompile.transform(model, ["cpu"] * 3, copy_replicas=True)

    def spy(rnn):
        seen.append((rnn is model.rnn, runtime.weights_in_one_buffer(rnn)))
        return original(rnn)

    for node in _flatten_nodes(pm):
        node.target = spy
    pm.recompile()
    pm(torch.randn(5, 6, 4))
    assert seen == [(True, False), (False, True), (False, True)]


def _exported(model, devices, x, **options):
    return dpcompile.transform(model, devices, frontend="export", example_inputs=(x,), **options)


def test_export_frontend_rnns_are_flattened_once_per_replica_before_they_run():
    """torch.export keeps an RNN call as ``aten.lstm`` / ``gru`` / ``rnn_tanh`` on the module's weights,
    with no module call: each RNN still gets one flatten call per replica, on that replica's module,
    before the first recurrent op, and forward and backward equal eager."""
    x = torch.randn(6, 4, 4)
    pm = _exported(Stack(), ["cpu"] * 2, x, copy_replicas=True)
    calls = _flatten_nodes(pm)
    assert len(calls) == 3 * 2
    order = list(pm.graph.nodes)
    recurrent = [n for n in order if getattr(n.target, "_opname", None) in ("lstm", "gru", "rnn_tanh")]
    assert len(recurrent) == 3 * 2 and max(map(order.index, calls)) < min(map(order.index, recurrent))
    assert "dpcompile_runtime_flatten_parameters(rnn_dev1)" in pm.code  # replica 1's own enc.rnn
    check_against_eager(Stack, ["cpu"] * 2, x, transform_kwargs={"frontend": "export", "example_inputs": (x,)})


def _rnn_model_on(device):
    model = Encoder(nn.LSTM, num_layers=2, bidirectional=True).to(device)
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("layout", ["same_gpu_twice", "all_gpus"])
def test_cuda_replicas_emit_no_contiguity_warning(layout, frontend):
    """On CUDA no replica warns about non-contiguous RNN weights; each replica's weights share one buffer."""
    devices = ["cuda:0", "cuda:0"] if layout == "same_gpu_twice" else list(range(torch.cuda.device_count()))
    model = _rnn_model_on("cuda:0")
    reference = copy.deepcopy(model)
    x = torch.randn(5, 2 * len(devices), 4, device="cuda:0")
    pm = dpcompile.transform(model, devices, copy_replicas=True, frontend=frontend, example_inputs=(x,))
    pointers = []
    original = runtime.flatten_parameters

    def spy(rnn):
        pointers.append({w.untyped_storage().data_ptr() for w in rnn._flat_weights})
        return original(rnn)

    for node in _flatten_nodes(pm):
        node.target = spy
    pm.recompile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pm(x)
        out.sum().backward()
    assert not [w for w in caught if "contiguous chunk of memory" in str(w.message)]
    assert len(pointers) == len(devices) and all(len(p) == 1 for p in pointers)
    torch.testing.assert_close(out, reference(x), atol=1e-4, rtol=1e-4)
