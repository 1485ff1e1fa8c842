"""The runtime's movers: scatter, gather, broadcast and replicate."""

import collections

import pytest
import torch
from torch import nn

from dpcompile import runtime
from dpcompile.runtime.comm import Broadcast

Point = collections.namedtuple("Point", "x y")


def test_scatter_splits_balanced_like_tensor_split():
    """9 rows over 4 devices are 3, 2, 2, 2."""
    chunks = runtime.scatter(torch.arange(9), ["cpu"] * 4, 0)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]


def test_scatter_walks_nested_structures_and_keeps_non_tensors():
    """Dicts, namedtuples, lists are split leaf-wise; None and numbers go to every device."""
    value = {"p": Point(torch.zeros(4, 2), None), "n": 3, "l": [torch.ones(4)]}
    parts = runtime.scatter(value, ["cpu"] * 2, 0)
    assert len(parts) == 2
    assert isinstance(parts[1]["p"], Point) and parts[1]["p"].x.shape == (2, 2)
    assert parts[0]["n"] == 3 and parts[0]["p"].y is None and parts[1]["l"][0].shape == (2,)


def test_gather_concatenates_with_per_leaf_dims():
    """An LSTM-like (out, (h, c)) gathers out on dim 0 and h, c on dim 1."""
    parts = [(torch.zeros(2, 5), (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))) for _ in range(3)]
    out, (h, c) = runtime.gather(parts, (0, (1, 1)), "cpu")
    assert out.shape == (6, 5) and h.shape == (1, 6, 3) and c.shape == (1, 6, 3)


def test_gather_refuses_zero_dim_tensors():
    """Per-replica scalars must be reduced, not gathered."""
    with pytest.raises(ValueError, match="0-dim"):
        runtime.gather([torch.tensor(1.0), torch.tensor(2.0)], 0, "cpu")


def test_broadcast_backward_sums_gradients_on_the_source():
    """Broadcast copies forward; backward reduce-adds every copy's gradient."""
    w = torch.randn(3, requires_grad=True)
    copies = Broadcast.apply([torch.device("cpu")] * 3, [], w)
    assert all(c.data_ptr() != w.data_ptr() for c in copies)
    (copies[0] * 1 + copies[1] * 2 + copies[2] * 3).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))


def test_replicate_gives_independent_modules_with_shared_gradients():
    """Replicas compute like the original; their gradients land on the original."""
    lin = nn.Linear(3, 2)
    (r1, r2) = runtime.replicate({"lin": lin}, ["cpu", "cpu"], copy=True)
    assert r1.lin is not lin and r1.lin.weight is not lin.weight
    x = torch.randn(4, 3)
    (r1.lin(x).sum() + r2.lin(x).sum()).backward()
    torch.testing.assert_close(lin.weight.grad, 2 * x.sum(0).expand(2, 3))


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_replicate_lays_rnn_weights_into_one_buffer(kind):
    """A replica's RNN weights are views into one contiguous buffer, end to end in cuDNN's order:
    every matrix, then every bias (as cuDNN 9 flattens a 2-layer LSTM on an H200)."""
    rnn = kind(4, 5, num_layers=2, bidirectional=True)
    (root,) = runtime.replicate({"rnn": rnn}, ["cpu"], copy=True)
    names, weights = root.rnn._flat_weights_names, root.rnn._flat_weights
    assert runtime.weights_in_one_buffer(root.rnn)
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    laid = sorted(range(len(weights)), key=lambda k: weights[k].storage_offset())
    matrices = [n for n in names if n.startswith("weight")]
    assert [names[k] for k in laid] == matrices + [n for n in names if n.startswith("bias")]
    ends = [weights[k].storage_offset() + weights[k].numel() for k in laid]
    assert [weights[k].storage_offset() for k in laid] == [0, *ends[:-1]]
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(root.rnn(x)[0], rnn(x)[0])


def _lay_into_one_storage(rnn, names):
    """Point ``rnn``'s weights into one fresh storage, end to end in the order ``names``."""
    params = dict(rnn.named_parameters())
    buffer = torch.cat([params[n].detach().reshape(-1) for n in names])
    offset = 0
    with torch.no_grad():
        for n in names:
            p = params[n]
            p.set_(buffer.untyped_storage(), offset, p.shape, p.stride())
            offset += p.numel()


def test_weights_flattened_as_cudnn_lays_them_count_as_one_buffer():
    """cuDNN 9 flattens a 2-layer LSTM as every matrix, then every bias (seen on an H200): that is
    flat, and ``flatten_parameters`` must not copy it again each forward; a layer-by-layer layout
    is not what cuDNN reads, so it is not."""
    lstm = nn.LSTM(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3)
    expected = lstm(x)[0]
    names = list(lstm._flat_weights_names)
    _lay_into_one_storage(lstm, [n for n in names if n.startswith("weight")] + [n for n in names if n.startswith("bias")])
    assert runtime.weights_in_one_buffer(lstm)
    torch.testing.assert_close(lstm(x)[0], expected)
    _lay_into_one_storage(lstm, names)  # weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, weight_ih_l1, ...
    assert not runtime.weights_in_one_buffer(lstm)


def test_a_replica_rnn_forward_does_not_flatten_again(monkeypatch):
    """RNN.forward re-flattens (a copy of every weight on CUDA) when its weights are not the ones
    it last flattened; a replica's must count as its own (seen on an H200: one copy per step)."""
    lstm = nn.LSTM(3, 4, num_layers=2)
    (root,) = runtime.replicate({"rnn": lstm}, ["cpu"], copy=True)
    flattened = []
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", lambda self: flattened.append(self))
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(root.rnn(x)[0], lstm(x)[0])
    assert root.rnn not in flattened


def test_replicate_copies_a_flat_source_span_exactly():
    """Weights that already share a storage are copied as one span with the same offsets."""
    buffer = torch.randn(20)
    a, b = buffer[2:8].view(2, 3), buffer[10:16].view(3, 2)
    (copy_a, copy_b), = [Broadcast.apply([torch.device("cpu")], [[0, 1]], a, b)]
    assert copy_a.untyped_storage().data_ptr() == copy_b.untyped_storage().data_ptr()
    assert copy_b.storage_offset() - copy_a.storage_offset() == 8
    torch.testing.assert_close(copy_b, b)


def test_replicate_aliases_on_the_source_device():
    """Without copy=True a replica on the tensors' own device is the original module."""
    lin = nn.Linear(3, 2)
    (root,) = runtime.replicate({"lin": lin, "w": lin.weight}, ["cpu"])
    assert root.lin is lin and root.w is lin.weight


def test_flatten_parameters_skips_weights_already_in_one_buffer(monkeypatch):
    """runtime.flatten_parameters copies nothing when the weights are already one buffer."""
    rnn = nn.LSTM(3, 4)
    calls = []
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", lambda self: calls.append(self))
    (root,) = runtime.replicate({"rnn": rnn}, ["cpu"], copy=True)
    runtime.flatten_parameters(root.rnn)
    assert calls == []
    runtime.flatten_parameters(rnn)
    assert calls == [rnn]
