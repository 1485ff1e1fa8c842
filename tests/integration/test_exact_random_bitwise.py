"""Random ops draw the single-device values bit for bit (``exact_random=True``), in one process and
over a gloo mesh: a float32 model whose outputs are the random values themselves, or the same
element-wise arithmetic on them, equals eager's with ``torch.equal`` on every layout that splits them
(dp rows, tp columns and heads, pipeline micro-batches, FSDP, their combinations), and
``torch.get_rng_state()`` after each of two calls equals eager's (so the next call draws eager's too).

The parameters are multiples of 1/8 and the input integers, so every product and sum of the linear
layers is exact in float32: a layout that runs a matmul on a piece (dp x tp: rows and columns at
once) may sum in another order (BLAS picks its blocking by shape), and with generic weights the
column layer's output, and so ``x * dropout_mask``, differs from eager's in the last bit; that
arithmetic is not the draws', and the float64 training tests (``test_exact_random.py``) cover it. The
loss (a mean of micro-batch sums in a pipeline) is compared to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpcompile

#: the model's outputs after the loss: the column layer's (of the first dropout's values), one per random site
OUTPUTS = ("h", "dropout_module", "dropout", "native_dropout", "rand_like", "randn_like", "bernoulli", "bernoulli_p",
           "randint_like", "normal_", "uniform_", "attention")  # fmt: skip
CUT = ["col"]  # the second stage starts at the column layer: every output is computed there (over a
# mesh an output of an earlier stage fails in cut_stage with a KeyError: docs/limitations.md)
PLAN = {"col": "column", "row": "row", "q": "column", "k": "column", "v": "column", "o": "row"}


class RandomSites(nn.Module):
    """Dropout on the input's projection (its values times 2: the sums after it stay exact), then
    each random op on the output of a column layer (rows: the batch; under tp each shard's columns),
    returned as it is; SDPA with dropout over 2 heads of 3 column layers (under tp each shard its
    head). The loss sums them through row layers."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.drop_in = nn.Dropout(0.5)  # a site in a pipeline's first stage (pipeline=["col"])
        self.col = nn.Linear(d, 2 * d)
        self.drop = nn.Dropout(0.25)
        self.row = nn.Linear(2 * d, d)
        self.q, self.k, self.v = (nn.Linear(d, 2 * d) for _ in range(3))
        self.o = nn.Linear(2 * d, d)

    def forward(self, x):
        x = self.drop_in(self.inp(x))
        h = self.col(x)
        sites = [
            self.drop(h),
            F.dropout(h, 0.5, self.training),
            torch.native_dropout(h, 0.5, self.training)[0],
            h + torch.rand_like(h),
            torch.randn_like(h),
            torch.bernoulli(torch.sigmoid(h)),
            torch.bernoulli(h, 0.3),
            torch.randint_like(h, 10),
            (h * 2).normal_(),
            (h * 3).uniform_(-1.0, 1.0),
        ]
        b, s, _ = x.shape  # a later stage reads sizes of a value from an earlier stage
        q, k, v = (f(x).view(b, s, 2, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        attention = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25 if self.training else 0.0)
        total = sites[0]
        for site in sites[1:]:
            total = total + site
        y = self.row(total) + self.o(attention.transpose(1, 2).flatten(2))
        return (y.pow(2).mean(), h, *sites, attention)


def exact_model() -> RandomSites:
    """The model with parameters in {-2, ..., 2} / 8: its linear layers' sums exact in any order."""
    torch.manual_seed(0)
    model = RandomSites().train()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float() / 8)
    return model


def integer_inputs(rows: int) -> torch.Tensor:
    return torch.randint(-2, 3, (rows, 3, 8), generator=torch.Generator().manual_seed(1)).float()


def assert_calls_equal_eager(call, model: nn.Module, x: torch.Tensor, rows: slice = slice(None), *,
                             outputs: bool = True, loss: bool = True) -> None:  # fmt: skip
    """Two calls: each output (``rows`` of eager's) equal to eager's bit for bit, the loss to float32
    rounding (``loss``; over a mesh a rank's is its local batch's), and the generator's state after
    each equal to eager's."""
    for step in range(2):
        torch.manual_seed(10 + step)
        got = call()
        state = torch.get_rng_state()
        torch.manual_seed(10 + step)
        want = model(x)
        assert torch.equal(state, torch.get_rng_state()), f"the generator after call {step} is not eager's"
        if not outputs:
            continue
        if loss:
            torch.testing.assert_close(got[0].detach(), want[0].detach(), msg=lambda m, step=step: f"loss, call {step}: {m}")
        for name, a, b in zip(OUTPUTS, got[1:], want[1:]):
            assert torch.equal(a.detach(), b[rows].detach()), f"{name}, call {step}: not eager's bit for bit"


LAYOUTS = {
    "dp": {"mesh": {"dp": 2}},
    "fsdp": {"mesh": {"dp": 2}, "data_parallel": "fsdp"},
    "tp": {"mesh": {"tp": 2}, "tensor_parallel": PLAN},
    "gpipe": {"mesh": {"pp": 2}, "pipeline": CUT, "micro_batches": 2},
    "1f1b": {"mesh": {"pp": 2}, "pipeline": CUT, "micro_batches": 2, "schedule": "1f1b"},
    "dp_tp": {"mesh": {"dp": 2, "tp": 2}, "tensor_parallel": PLAN},
    "pp_tp": {"mesh": {"pp": 2, "tp": 2}, "pipeline": CUT, "micro_batches": 2, "tensor_parallel": PLAN},
    "pp_tp_1f1b": {"mesh": {"pp": 2, "tp": 2}, "pipeline": CUT, "micro_batches": 2, "schedule": "1f1b", "tensor_parallel": PLAN},
    "pp_dp": {"mesh": {"pp": 2, "dp": 2}, "pipeline": CUT, "micro_batches": 2},
    "pp_dp_1f1b": {"mesh": {"pp": 2, "dp": 2}, "pipeline": CUT, "micro_batches": 2, "schedule": "1f1b"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_sites_equal_eager_bit_for_bit(layout):
    """Every random site's values (each device its slice) and the generator after each of 2 calls are
    eager's, bit for bit, on every one-process layout; no site draws per device."""
    options = LAYOUTS[layout]
    model, x = exact_model(), integer_inputs(4)
    devices = 1
    for size in options["mesh"].values():
        devices *= size
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * devices, example_inputs=(x,), **options)
    pm.train()
    assert dpcompile.explain(pm, x).random["per_device"] == [], pm.code
    for site in ("drop", "randint_like", "written", "scaled_dot_product_attention"):  # each split by the layout
        calls = [line for line in pm.code.splitlines() if f"random_draws, '{site}'" in line]
        assert len(calls) == devices and all("rows = (" in c or "cols = (" in c for c in calls), (site, calls)
    assert_calls_equal_eager(lambda: pm(x), model, x)


class FillsAView(nn.Module):
    """``y[:, :3].normal_()`` on an activation, then dropout: the fill draws the view's values (its
    strides decide the CPU kernel's order), the dropout after it the next ones."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.fc(x) * 2
        y[:, :3].normal_()
        return y, self.drop(self.fc(x))


@pytest.mark.parametrize("layout", ["dp", "gpipe"])
def test_a_fill_of_a_view_draws_eagers_values(layout):
    """A fill of a view of an activation splits with the batch: each piece writes its slice of the
    whole view's fill (in a pipeline, run on the gathered batch it drew after micro-batch 0 had drawn
    the dropout, and both differed from eager's); the filled elements pass no gradient, as eager's."""
    torch.manual_seed(0)
    model = FillsAView()
    x = integer_inputs(4)[:, 0, :4]
    options = {"pipeline": 2, "micro_batches": 2} if layout == "gpipe" else {}
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 2, example_inputs=(x,), **options)
    assert "exact_written_fill" in pm.code, pm.code
    for step in range(2):
        torch.manual_seed(10 + step)
        got = pm(x)
        state = torch.get_rng_state()
        (got[0].sum() + got[1].sum()).backward()
        torch.manual_seed(10 + step)
        want = model(x)
        (want[0].sum() + want[1].sum()).backward()
        assert torch.equal(state, torch.get_rng_state()), f"the generator after call {step} is not eager's"
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, want)), f"call {step}"
        torch.testing.assert_close(pm.get_parameter("fc.weight").grad, model.fc.weight.grad)
        pm.zero_grad()
        model.zero_grad()


# ---------------------------------------------------------------------- over a gloo mesh
GROUP_TIMEOUT_S = 600.0


def check_over_mesh(layout: dict[str, int], data_parallel: str = "ddp", schedule: str | None = None) -> None:
    """One rank's cell: the program over the mesh on its local batch (2 rows per dp rank), 2 calls;
    its outputs (its rows; a pipeline's last stage) equal eager's on the global batch bit for bit, and
    every rank's generator state after each call equals eager's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))
    dp_rank = mesh.get_local_rank("dp") if "dp" in layout else 0
    model, x = exact_model(), integer_inputs(2 * layout.get("dp", 1))
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)
    options: dict = {"tensor_parallel": PLAN} if "tp" in layout else {}
    if data_parallel != "ddp":
        options["data_parallel"] = data_parallel
    if schedule is not None:
        options.update(pipeline=CUT, micro_batches=2, schedule=schedule)
    pm = dpcompile.transform(copy.deepcopy(model), mesh, example_inputs=(x[rows],), **options)
    pm.train()
    last = schedule is None or mesh.get_local_rank("pp") == layout["pp"] - 1
    assert_calls_equal_eager(lambda: pm(x[rows]), model, x, rows, outputs=last, loss=False)


#: the cells over a mesh, by group size: (mesh, data parallel, pipeline schedule or None)
MESH_CELLS = {
    2: {"dp": ({"dp": 2}, "ddp", None), "fsdp": ({"dp": 2}, "fsdp", None), "tp": ({"tp": 2}, "ddp", None),
        "gpipe": ({"pp": 2}, "ddp", "gpipe"), "1f1b": ({"pp": 2}, "ddp", "1f1b")},
    4: {"dp_tp": ({"dp": 2, "tp": 2}, "ddp", None), "pp_tp": ({"pp": 2, "tp": 2}, "ddp", "1f1b"),
        "pp_dp": ({"pp": 2, "dp": 2}, "ddp", "gpipe")},
}  # fmt: skip


def _entry(rank: int, world: int, port: int, results) -> None:
    import functools

    from tests.gloo_groups import run_checks

    checks = [(name, functools.partial(check_over_mesh, *spec)) for name, spec in MESH_CELLS[world].items()]
    run_checks(rank, world, port, checks, results)


_OUTCOMES: dict[int, dict] = {}


def _assert_mesh_cell_passed(world: int, cell: str) -> None:
    from tests.gloo_groups import assert_group_passed, run_spawned

    if world not in _OUTCOMES:
        _OUTCOMES[world] = run_spawned(_entry, world, timeout=GROUP_TIMEOUT_S)
    assert_group_passed(_OUTCOMES[world], world, cell, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cell", list(MESH_CELLS[2]))
@pytest.mark.xdist_group("exact_random_bitwise_2")  # one spawned group, on one worker
def test_random_sites_equal_eager_bit_for_bit_over_two_ranks(cell):
    """dp (DDP, FSDP), tp and pp (GPipe, 1F1B) over 2 gloo ranks: each rank's outputs (its rows, its
    pipeline stage's) equal eager's on the global batch bit for bit; every rank's generator too."""
    _assert_mesh_cell_passed(2, cell)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("cell", list(MESH_CELLS[4]))
@pytest.mark.xdist_group("exact_random_bitwise_4")  # one spawned group, on one worker
def test_random_sites_equal_eager_bit_for_bit_over_four_ranks(cell):
    """dp x tp, pp x tp (1F1B) and pp x dp (GPipe) over 4 gloo ranks, as over 2."""
    _assert_mesh_cell_passed(4, cell)
