"""Context parallel against data parallel: peak activation bytes per device of one training step of a
4-layer causal decoder at a long sequence on 4 virtual devices, at the same global batch, as a ratio
measured in the same run.

    PYTHONPATH=. python benchmarks/bench_context_parallel.py [--seq 4096] [--batch 1] [--exchange ring|all-to-all] [--json]

- peak: ``dpcompile.measure``'s ``step_allocated_peak`` (the bytes a step allocates on each virtual
  device, each storage counted against the device of the node that made it, until freed), the
  largest over the devices;
- data parallel splits the batch, so a global batch smaller than the devices leaves some idle (a
  batch of 1 runs whole on one device); context parallel splits the sequence, whatever the batch.
  At a batch of at least the device count both hold the same number of tokens per device, and
  context parallel adds each attention's gathered keys and values while it runs (forward, and
  again in backward): compare with ``--batch 4``.
- ``--exchange ring`` / ``--exchange all-to-all``: context parallel by that exchange too
  (``context_parallel=``), its peak against the all-gather's in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from benchmarks.common import RESULTS


class Block(nn.Module):
    """Pre-norm causal attention and an MLP, positions learned."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 4, max_seq: int = 8192):
        super().__init__()
        self.pos = nn.Embedding(max_seq, d)
        self.layers = nn.ModuleList([Block(d, heads) for _ in range(layers)])

    def forward(self, x):
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def peak_activation_bytes(mesh: dict[str, int], x: torch.Tensor, model: nn.Module, **options) -> int:
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh=mesh, example_inputs=(x,), **options)
    return max(dpcompile.measure(pm, x).step_allocated_peak.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--exchange", choices=["all-gather", "ring"], default="all-gather",
                        help="ring: measure context parallel on the ring too, against the all-gather")
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/context_parallel.json")
    parser.add_argument("--exchange", choices=["all-to-all"], help="also context parallel by this exchange")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder()
    x = torch.randn(args.batch, args.seq, 64)
    dp = peak_activation_bytes({"dp": 4}, x, model)
    cp = peak_activation_bytes({"cp": 4}, x, model)
    row = {"seq": args.seq, "batch": args.batch, "devices": 4, "layers": 4, "dp_peak_bytes": dp, "cp_peak_bytes": cp,
           "cp_over_dp": cp / dp}  # fmt: skip
    print(f"4-layer decoder, batch {args.batch} x seq {args.seq} on 4 virtual devices: peak activation bytes per "
          f"device: data parallel {dp:,}, context parallel {cp:,}: {cp / dp:.2f}x")  # fmt: skip
    if args.exchange == "ring":
        ring = peak_activation_bytes({"cp": 4}, x, model, context_parallel={"exchange": "ring"})
        print(f"  context parallel on the ring: {ring:,} B per device, {ring / cp:.2f}x the all-gather's, "
              f"{ring / dp:.2f}x data parallel's")  # fmt: skip
        row.update(ring_peak_bytes=ring, ring_over_all_gather=ring / cp)
    if args.json:
        name = "context_parallel.json" if not args.exchange else f"context_parallel_{args.exchange}.json"
        (RESULTS / name).write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
