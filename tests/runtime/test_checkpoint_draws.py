"""A recomputed region reads the call's random draws as its first run did: a pipeline stage's record
(``PlannedDraws``) counts the micro-batches by the times a site is reached, which the recompute in
backward must not count again; and the regions of a rank's program read the record, not remake it."""

from __future__ import annotations

import torch

import passes
from dpcompile.capture import capture
from dpcompile.devices import Devices
from dpcompile.infra import run_passes
from dpcompile.runtime import checkpoint, exact_dropout
from dpcompile.runtime.random_plan import PlannedDraws
from tests.integration.test_activation_checkpointing_mesh import DropoutBlock, DropoutStack


def test_a_recomputed_micro_batch_keeps_its_rows_of_the_draws():
    """Two micro-batches of one row through a checkpointed dropout (the plan's draw is the whole mask
    itself), then backward: each recompute takes its own micro-batch's row of it (without replaying, the
    third visit had no row: an IndexError), so each gradient is the row its forward used."""
    torch.manual_seed(0)
    draws = PlannedDraws([("drop", (2, 8), lambda shape: torch.rand(shape, dtype=torch.float64))], [1, 1],
                         first_piece=0, own=frozenset({"drop"}))  # fmt: skip
    xs = [torch.ones(1, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]

    def region(x, record):
        return exact_dropout(record, "drop", x, 0.5, True, rows=(0, 0))

    outs = [checkpoint(region, x, draws) for x in xs]
    torch.autograd.backward([o.sum() for o in reversed(outs)])  # the second micro-batch's backward first
    mask = draws.drawn["drop"]
    for k, (x, out) in enumerate(zip(xs, outs)):
        assert torch.equal(out.detach(), mask[k : k + 1]), k  # x * m with x = 1
        assert torch.equal(x.grad, mask[k : k + 1]), k
    assert draws.reached == {"drop": 2}  # the count of the call goes on as the forward left it


def test_regions_of_a_rank_program_read_the_record_of_draws():
    """FSDP's blocks under exact random over a dp mesh (one rank's program, built here without a mesh):
    each block's region reads ``random_draws_over_ranks`` and does not remake it (it used to join the
    first region, whose output then clashed with the region's name)."""
    gm = capture(DropoutStack().double(), leaf_modules=(DropoutBlock,))
    options = passes.PipelineOptions(devices=Devices((torch.device("cpu"),)), input_dims={"x": 0, "labels": 0},
                                     exact_random=True)  # fmt: skip
    scopes = ("layers.0", "layers.1")
    gm, _ = run_passes(gm, passes.frontend_pipeline(options)
                       + passes.rank_rows_pipeline(options, dp_rank=0, scopes=scopes)
                       + passes.exact_random_rank_pipeline(options, tp_rank=None, dp_size=2, scopes=scopes)
                       + passes.checkpoint_pipeline(scopes))  # fmt: skip
    code = gm.code
    assert code.count("dpcompile_runtime_random_draws_over_ranks(") == 1, code
    for region in ("layers_0", "layers_1"):
        assert f"{region} = dpcompile_runtime_checkpoint({region}_region, random_draws, " in code, code
        assert "random_draws_over_ranks" not in getattr(gm, f"{region}_region").code
