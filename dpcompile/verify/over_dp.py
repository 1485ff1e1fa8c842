"""``verify`` of data parallelism over a DeviceMesh (DDP or FSDP2): every dp rank passes the same
inputs, so dp's mean of the gradients is the eager model's; the one thing that then differs from an
eager call is what synchronised BatchNorm counts.

A BatchNorm in training over ``W`` dp ranks normalises with the statistics of every rank's rows: the
same batch ``W`` times gives the same mean and (biased) variance, but the running variance is updated
with the unbiased variance of ``W * n`` rows, ``var * W*n / (W*n - 1)``, not ``var * n / (n - 1)``.
:func:`running_variance_over_copies` turns the eager run's running variance into that one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.modules.executors import executor_of
from dpcompile.verify.mesh_pipeline import input_fingerprint, ranks_with_other_inputs


@dataclass(frozen=True)
class OverDp:
    """The dp ranks that ran the same inputs, and the note verify's result carries."""

    ranks: int
    note: str


def agree_on_inputs_over_dp(pm: nn.Module, args: tuple, kwargs: dict) -> OverDp | None:
    """DDP or FSDP over a DeviceMesh: verify compares each rank's call with the eager model on the
    same inputs, so every dp rank must pass the same ones (then dp's mean of the gradients is the
    eager model's). One exchange over dp; inputs that differ raise the same error on every rank.
    None where ``pm`` has no dp over a mesh."""
    if not executor_of(pm).call_runs_under_dp(pm):
        return None
    import torch.distributed as dist

    group = pm.mesh.get_group(pm.dp_dim)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, input_fingerprint(args, kwargs), group=group)
    ranks = dist.get_process_group_ranks(group)
    differ = ranks_with_other_inputs(ranks, everyone)
    if differ:
        raise DpCompileError(
            f"verify of data parallelism over a mesh compares each rank's call with the eager model on the same "
            f"inputs (dp's mean of the gradients is then the eager model's), but global rank(s) {', '.join(differ)} "
            f"passed other inputs than rank {ranks[0]} (shapes, dtypes or values). Call verify(pm, model, *inputs) "
            "with the same inputs on every rank, not each rank's part of the batch"
        )
    return OverDp(len(ranks), f"data parallelism over a mesh of {len(ranks)} dp ranks: every rank ran the same inputs; "
                  "the gradients compared are dp's mean" + (" (FSDP's shards gathered)" if pm.fsdp is not None else ""))


@contextlib.contextmanager
def batch_norm_rows(model: nn.Module) -> Iterator[dict[str, list[int]]]:
    """``{module path: [rows per channel, one per call]}`` of every BatchNorm of ``model`` that updates
    its running statistics in the calls made inside the block."""
    rows: dict[str, list[int]] = {}
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training and module.track_running_stats:
            def count(module: nn.Module, inputs: tuple, path: str = path) -> None:
                rows.setdefault(path, []).append(inputs[0].numel() // inputs[0].shape[1])

            handles.append(module.register_forward_pre_hook(count))
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


def running_variance_over_copies(model: nn.Module, rows: dict[str, list[int]], before: dict[str, torch.Tensor],
                                 after: dict[str, torch.Tensor], copies: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """The running variances (buffer name -> value) that synchronised BatchNorm reaches over ``copies``
    dp ranks that each ran the batch of the eager call, from the eager call's ``before`` and ``after``:

        after  = (1 - f) * before + f * var * n / (n - 1)            (eager, n rows)
        wanted = (1 - f) * before + f * var * W*n / (W*n - 1)        (W copies)

    A BatchNorm called more than once in the step is left to the eager value."""
    wanted = {}
    modules = dict(model.named_modules())
    for path, counts in rows.items():
        name = f"{path}.running_var" if path else "running_var"
        if len(counts) != 1 or counts[0] <= 1 or name not in before or name not in after:
            continue
        bn, n = modules[path], counts[0]
        if bn.momentum is None:  # a cumulative average: the weight of this batch is 1 / batches seen
            f = 1.0 / float(bn.num_batches_tracked)
        else:
            f = float(bn.momentum)
        kept = (1 - f) * before[name]
        wanted[name] = kept + (after[name] - kept) * (copies * n / (copies * n - 1)) * ((n - 1) / n)
    return wanted
