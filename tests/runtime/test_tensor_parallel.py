"""The single-process tensor-parallel runtime (:mod:`dpcompile.runtime.tensor_parallel`)."""

from __future__ import annotations

import torch

from dpcompile.runtime import tensor_parallel as tp_runtime


def test_runtime_copy_to_devices_backward_sums_the_shards_gradients():
    """f's single-process form: the input's gradient is the sum over the copies (the all-reduce)."""
    x = torch.ones(2, requires_grad=True)
    a, b = tp_runtime.copy_to_devices(x, ["cpu", "cpu"])
    (2 * a + 3 * b).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 5.0))


def test_runtime_split_and_gather_are_inverse_with_uneven_sizes():
    """Splitting 10 columns 4/3/3 and gathering them gives the tensor back."""
    x = torch.randn(2, 10)
    parts = tp_runtime.split_to_devices(x, -1, [4, 3, 3], ["cpu"] * 3)
    assert [p.shape[-1] for p in parts] == [4, 3, 3]
    torch.testing.assert_close(tp_runtime.gather_to_device(parts, -1, "cpu"), x)


def test_shard_spec_sections_round_trip():
    """A fused (3-section) spec: each shard holds its slice of every section; unshard and regroup rebuild the whole."""
    from dpcompile.runtime.tensor_parallel import ShardSpec, regroup_sections, shard_of, unshard

    full = torch.arange(18.0).view(9, 2)  # q, k, v of 3 rows each, split 2 + 1
    spec = ShardSpec(0, (6, 3), sections=3)
    shards = [shard_of(full, spec, k) for k in range(2)]
    assert shards[1][:, 0].tolist() == [4.0, 10.0, 16.0]
    torch.testing.assert_close(unshard(shards, spec, "cpu"), full)
    torch.testing.assert_close(regroup_sections(torch.cat(shards), spec), full)


def test_masked_embedding_sums_to_the_lookup():
    """Vocab-parallel lookups over every shard's rows sum to the whole lookup."""
    from dpcompile.runtime.tensor_parallel import masked_embedding

    table = torch.randn(7, 3)
    ids = torch.tensor([[0, 6, 3], [4, 4, 1]])
    parts = [masked_embedding(ids, table[:4], 0), masked_embedding(ids, table[4:], 4)]
    torch.testing.assert_close(parts[0] + parts[1], torch.nn.functional.embedding(ids, table))


def test_vocab_parallel_cross_entropy_parts_equal_cross_entropy():
    """logsumexp parts and target logits of two vocab shards give F.cross_entropy, ignore_index kept."""
    from dpcompile.runtime.tensor_parallel import cross_entropy_from_parts, shard_logsumexp, shard_target_logit

    logits, target = torch.randn(5, 9), torch.tensor([0, 8, 4, -100, 5])
    a, b = logits[:, :5], logits[:, 5:]
    lse = torch.cat([shard_logsumexp(a), shard_logsumexp(b)], -1)
    picked = shard_target_logit(a, target, 0) + shard_target_logit(b, target, 5)
    torch.testing.assert_close(cross_entropy_from_parts(lse, picked, target), torch.nn.functional.cross_entropy(logits, target))


def test_call_module_on_device_sums_its_copies_gradients_into_the_parameter(monkeypatch):
    """A norm called on two halves of the sequence, the second through ``call_module_on_device``
    reading real copies of its parameters (a distinct device's; here a differentiable clone): the
    output and the parameters' gradients equal the norm called on the whole."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    copied: list[torch.Tensor] = []

    def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        copied.append(t)
        return t.clone()

    monkeypatch.setattr(tp_runtime, "_move", move)
    got = torch.cat([norm(x[:, :3]), tp_runtime.call_module_on_device(norm, "cpu", x[:, 3:])], 1)
    assert {id(t) for t in copied} == {id(norm.weight), id(norm.bias)}
    got.square().sum().backward()
    got_grads = [p.grad.clone() for p in (norm.weight, norm.bias)]
    norm.zero_grad()
    want = norm(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for got_grad, p in zip(got_grads, (norm.weight, norm.bias)):
        torch.testing.assert_close(got_grad, p.grad)


def test_call_module_on_device_leaves_a_module_with_a_child_reached_twice_as_it_was():
    """A leaf module whose Linear is reached under two names: the copies on ``device`` (meta here)
    were left as its parameters by torch.func.functional_call."""

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = self.a

        def forward(self, x):
            return self.b(self.a(x))

    module = Twice()
    weight, bias = module.a.weight, module.a.bias
    out = tp_runtime.call_module_on_device(module, "meta", torch.ones(2, 4, device="meta"))
    assert out.is_meta and out.shape == (2, 4)
    assert module.a._parameters["weight"] is weight and module.a._parameters["bias"] is bias
