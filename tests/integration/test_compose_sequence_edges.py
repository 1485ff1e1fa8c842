"""What a user does next with the composed sequence layouts (``docs/layouts.md``): the calls at the
edges of the shapes the layout was built for, each equal to eager's in float64.

Reuses ``test_compose_sequence``'s tiny GPT-like model.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import full_gradients
from tests.integration.test_compose_sequence import build, lm_batch


@pytest.mark.parametrize("mesh", [{"cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 2}])
def test_first_call_of_one_row_and_one_token_runs_like_eager(mesh):
    """A first call of one row of one token: one piece of the sequence, fewer than cp, so the program
    is built again for it; with batch and sequence both of size 1 the view before attention cannot
    say which dim is the sequence's, and its one piece has no keys to gather from other pieces (it
    was refused as 'cannot run on sequence shards'). Logits, loss and every gradient equal eager's,
    in training and in eval mode."""
    pm, eager = build(1, mesh, rows=2)
    ids, labels = lm_batch(1, 1, seed=4)
    (logits, loss), (want_logits, want_loss) = pm(ids, labels), eager(ids, labels)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)
    (loss + logits.sum()).backward()
    (want_loss + want_logits.sum()).backward()
    grads = full_gradients(pm) if hasattr(pm, "param_shards") else {n: p.grad for n, p in pm.named_parameters()}
    for path, p in eager.named_parameters():
        torch.testing.assert_close(grads[path], p.grad, msg=lambda m, path=path: f"grad {path}: {m}")
    pm.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, labels)[0], eager(ids, labels)[0])
