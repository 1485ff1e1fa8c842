"""``runtime.distributed.attention_over_group`` over a 2-process gloo group: each rank's queries, keys and values
are its shard of the sequence (uneven: 4 and 3 of 7); its rows of the output and the gradients of its
shards equal whole-sequence attention's (float64), causal and with a mask of its query rows."""

from __future__ import annotations

import functools

import pytest
import torch.multiprocessing as mp

from tests.gloo_groups import assert_group_passed, run_checks, run_spawned

GROUP_TIMEOUT_S = 300.0  # spawning, importing and the first gloo connections are slow on a loaded machine
WORLD = 2
SIZES = (4, 3)
CASES = ("causal", "mask")


def check_attention(case: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from dpcompile.runtime.distributed import attention_over_group

    rank, causal = dist.get_rank(), case == "causal"
    g = torch.Generator().manual_seed(0)  # the same whole tensors on every rank
    q, k, v = (torch.randn(2, 2, 7, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    weight = torch.randn(2, 2, 7, 4, dtype=torch.float64, generator=g)
    mask = None if causal else (torch.rand(2, 1, 7, 7, generator=g) > 0.4) | torch.eye(7, dtype=torch.bool)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    grads = torch.autograd.grad((whole * weight).sum(), (q, k, v))
    start, rows = sum(SIZES[:rank]), SIZES[rank]
    mine = slice(start, start + rows)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    kwargs = {} if causal else {"attn_mask": mask[:, :, mine]}
    positions = torch.arange(start, start + rows) if causal else None
    out = attention_over_group(*local, None, 2, SIZES, positions, **kwargs)
    torch.testing.assert_close(out, whole[:, :, mine])
    (out * weight[:, :, mine]).sum().backward()
    for name, t, want in zip("qkv", local, grads):
        torch.testing.assert_close(t.grad, want[:, :, mine], msg=lambda m, name=name: f"grad {name}: {m}")


def _entry(rank: int, world: int, port: int, results: mp.Queue) -> None:
    run_checks(rank, world, port, [(case, functools.partial(check_attention, case)) for case in CASES], results)


@pytest.fixture(scope="module")
def outcomes():
    return run_spawned(_entry, WORLD, timeout=GROUP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.slow  # one spawned group of 2 processes for both cases
@pytest.mark.parametrize("case", CASES)
@pytest.mark.xdist_group("attention_over_group")  # one spawned group, on one worker
def test_attention_over_group_equals_whole_attention(outcomes, case):
    """Outputs and every shard's gradient (keys' and values' summed over the ranks onto their owner)
    equal whole-sequence attention's rows."""
    assert_group_passed(outcomes, WORLD, case, timeout=GROUP_TIMEOUT_S)
