"""Training checkpoints of ``data_parallel="fsdp"`` in one process: the small LM of
``test_training_checkpoint.py`` (fused qkv, a tied vocab-parallel LM head; float64) trained one
AdamW step under FSDP over dp (3 copies: uneven pieces), dp x tp or pp x dp, saved, and loaded
under a replicated, tensor-parallel or pipeline layout and another FSDP layout (and those
saved into FSDP): parameters and AdamW state bit-identical to what was saved, the next 2 steps'
losses and parameters equal the uninterrupted eager run."""

from __future__ import annotations

import pytest
import torch

import dpcompile
from tests.integration import test_training_checkpoint as base
from tests.integration.test_training_checkpoint import (
    FSDP_LAYOUTS,
    LAYOUTS,
    batches,
    program,
    saved,
    state_in_model_layout,
    train_step,
)

folder, eager = base.folder, base.eager  # its module fixtures: the saved checkpoints and eager run, here too

# the six layouts of issue 32 in one process are LAYOUTS' four (their 12 pairs: test_training_checkpoint.py)
# and FSDP, FSDP x TP: every pair with an FSDP end (18), and pp x FSDP saved and loaded both ways
SIX = ["fsdp3", "fsdp2xtp2", *LAYOUTS]
PAIRS = [(a, b) for a in SIX for b in SIX if a != b and (a in FSDP_LAYOUTS or b in FSDP_LAYOUTS)]
PAIRS += [("pp2xfsdp2", "dp3"), ("pp2xfsdp2", "fsdp2xtp2"), ("pp2xtp2", "pp2xfsdp2"), ("fsdp3", "pp2xfsdp2")]


@pytest.mark.parametrize(("source", "dest"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_fsdp_checkpoint_resumes_under_another_layout(source, dest, folder, eager):
    before = saved(source, folder)
    pm = program(dest)[0]
    opt = torch.optim.AdamW(pm.parameters(), lr=1.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    dpcompile.load_checkpoint(pm, before["path"], optimizer=opt, lr_scheduler=sched)
    for key, value in pm.state_dict().items():
        assert torch.equal(value, before["params"][key]), key
    for name in ("exp_avg", "exp_avg_sq"):
        for key, value in state_in_model_layout(pm, opt, name).items():
            assert torch.equal(value, before[name][key]), (name, key)
    losses, params = eager
    resumed = [train_step(pm, opt, sched, b) for b in batches()[1:]]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-12, atol=0)
    for key, value in pm.state_dict().items():
        torch.testing.assert_close(value, params[key], rtol=1e-10, atol=1e-12, msg=key)


def test_fsdp_optimizer_state_is_sharded_like_its_parameters(folder):
    """AdamW's state of each piece has the piece's shape: the state is stored once, split over dp."""
    pm, opt, sched = program("fsdp2xtp2")
    train_step(pm, opt, sched, batches()[0])
    for name, p in pm.named_parameters():
        assert ".parametrizations." in name, name
        assert opt.state[p]["exp_avg"].shape == p.shape, name
