"""Hand-written blocks with unusual ops between a column and a row layer, found by probing
``tensor_parallel=`` as a user would: each equals eager (output and every gradient)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpcompile

PLAN = {"fc1": "column", "fc2": "row"}


class Between(nn.Module):
    """``fc2(op(fc1(x)))``: the op sees fc1's output sharded along its 12 features."""

    def __init__(self, op):
        super().__init__()
        self.fc1, self.fc2, self.op = nn.Linear(8, 12), nn.Linear(12, 8), op

    def forward(self, x):
        return self.fc2(self.op(self.fc1(x)))


def _equal_to_eager(op, n: int) -> dpcompile.ParallelModule:
    torch.manual_seed(0)
    model = Between(op).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=PLAN, example_inputs=(x,))
    out, expected = pm(x), model(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    full = {k: torch.cat([pm.get_parameter(f"{k}_shard{i}").grad for i in range(n)], dim)
            for k, dim in (("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1))}  # fmt: skip
    full["fc2.bias"] = pm.get_parameter("fc2.bias").grad
    for key, grad in full.items():
        torch.testing.assert_close(grad, model.get_parameter(key).grad, msg=key)
    return pm


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    ("name", "op", "gathers"),
    [
        ("sort(..).values", lambda h: torch.sort(h, 1).values, 0),  # a named field of a sharded tuple: a part
        ("cummax(..).values", lambda h: torch.cummax(h, 1).values, 0),
        ("max(..).values", lambda h: h - h.max(1, keepdim=True).values, 0),
        ("cat(chunk(..))", lambda h: torch.cat(h.chunk(5, 1), 1), 1),  # the tuple read whole: the op runs whole
        ("stack(unbind(..))", lambda h: torch.stack(torch.unbind(h, 1), 1), 1),
        ("cat(sort(..))", lambda h: torch.cat(torch.sort(h, 1), 1)[:, :5], 1),
    ],
)
def test_a_tuple_of_sharded_results_is_read_a_part_at_a_time_or_gathered_first(name, op, gathers, n):
    """Before: the shards' tuples (sort's values and indices) were all-gathered as if tensors (an
    AttributeError on ``.device``), whether read by field name or passed whole to ``torch.cat``."""
    pm = _equal_to_eager(op, n)
    assert pm.code.count("gather_to_device") == gathers, name


def test_a_data_dependent_size_between_the_pair_is_planned_and_equals_eager():
    """``nonzero()`` / ``masked_select()`` of the hidden activations: sizes only a run knows (unbacked
    symbols). Before: the planner read them as ints, GuardOnDataDependentSymNode out of transform."""
    torch.manual_seed(0)
    model = Between(lambda h: h + h.nonzero().shape[0] + h.masked_select(h > 0).sum()).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pm = dpcompile.transform(model, ["cpu"] * 2, tensor_parallel=True, example_inputs=(x,))
    assert pm.plan == PLAN
    torch.testing.assert_close(pm(x), model(x))


class TiedBiasHead(nn.Module):
    """BERT's LM head: ``self.bias`` tied to ``decoder.bias``, forward reading only the decoder."""

    def __init__(self):
        super().__init__()
        self.fc, self.decoder = nn.Linear(8, 16), nn.Linear(16, 12)
        self.bias = nn.Parameter(torch.zeros(12))
        self.decoder.bias = self.bias

    def forward(self, x):
        return self.decoder(torch.relu(self.fc(x)))


@pytest.mark.parametrize("mesh", [{"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}], ids=["dp2tp2", "pp2tp2"])
def test_a_tied_name_forward_never_reads_saves_the_trained_shards_over_a_mesh(mesh):
    """Before: over a mesh in one process ``bias`` stayed a separate full parameter the program never
    read, so after a step ``state_dict()['bias']`` was its stale initial value (the decoder's bias
    trained right): a checkpoint with two values for one tied tensor."""
    torch.manual_seed(0)
    model, x = TiedBiasHead().double(), torch.randn(4, 8, dtype=torch.float64)
    reference = TiedBiasHead().double()
    reference.load_state_dict(model.state_dict())
    pm = dpcompile.transform(model, ["cpu"] * 4, mesh=mesh, tensor_parallel={"fc": "replicate", "decoder": "column"},
                             example_inputs=(x,), micro_batches=2 if "pp" in mesh else 1)  # fmt: skip
    for program in (pm, reference):
        opt = torch.optim.AdamW(program.parameters(), lr=0.1)
        program(x).square().mean().backward()
        opt.step()
    got, want = pm.state_dict(), reference.state_dict()
    assert list(got) == list(want) == ["bias", "fc.weight", "fc.bias", "decoder.weight", "decoder.bias"]
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)
