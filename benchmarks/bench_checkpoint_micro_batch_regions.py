"""Activation checkpointing in a GPipe pipeline: torchvision's ViT (tiny: d=64, mlp 256, 16 images of
32x32) with ``activation_checkpointing=True`` over ``pipeline=2``, measured peak per device with a
region per block and micro-batch against the rule before (the gather of a block's micro-batch outputs,
which the next EncoderBlock's ``input.dim()`` check reads, left inside the block's region: one region
over every micro-batch, recomputed all at once in backward), as ratios before/after in one run.

    PYTHONPATH=. python benchmarks/bench_checkpoint_micro_batch_regions.py

The rule before is restored by replacing ``passes.checkpoint_activations._without_joins`` with the
identity while the program is built. Peaks come from ``dpcompile.measure`` (deterministic on CPU).
"""

from __future__ import annotations

import re
import sys

import torch

import dpcompile
import passes.checkpoint_activations  # noqa: F401  (the module; the package exports the pass under its name)
from tests.thirdparty import import_torchvision

PASS_MODULE = sys.modules["passes.checkpoint_activations"]


def measured(layers: int, micro_batches: int, *, before: bool) -> tuple[dict[str, int], int]:
    """Per-device peak bytes of one training step, and the number of checkpoint regions."""
    torch.manual_seed(0)
    model = import_torchvision().models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=layers, num_heads=2, hidden_dim=64, mlp_dim=256
    )
    x = torch.randn(16, 3, 32, 32)
    kept = PASS_MODULE._without_joins
    if before:
        PASS_MODULE._without_joins = lambda nodes, order: nodes
    try:
        pm = dpcompile.transform(model, ["cpu"] * 2, pipeline=2, micro_batches=micro_batches, activation_checkpointing=True)
        pm(x)  # built on the first call
    finally:
        PASS_MODULE._without_joins = kept
    return dpcompile.measure(pm, x).peak_bytes, len(re.findall(r"= dpcompile_runtime_checkpoint\(", pm.code))


def main() -> None:
    print("layers  micro-batches  regions before/after  peak before/after per device  max over devices")
    for layers in (2, 4, 6):
        for micro_batches in (2, 4):
            old, old_regions = measured(layers, micro_batches, before=True)
            new, new_regions = measured(layers, micro_batches, before=False)
            ratios = {d: round(old[d] / new[d], 3) for d in old}
            print(f"{layers:6}  {micro_batches:13}  {old_regions:>7} / {new_regions:<12} {ratios}  "
                  f"{max(old.values()) / max(new.values()):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
