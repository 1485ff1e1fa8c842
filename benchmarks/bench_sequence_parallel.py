"""Sequence parallel against tensor parallel alone: peak activation bytes per device of one training
step of a 4-layer causal decoder on 4 virtual devices (``mesh={"tp": 4}``, with and without
``sequence_parallel=True``), as a ratio measured in the same run.

    PYTHONPATH=. python benchmarks/bench_sequence_parallel.py [--seq 4096] [--json]

- peak: ``dpcompile.measure``'s ``step_allocated_peak`` (the bytes a step allocates on each virtual
  device, each storage counted against the device of the node that made it, until freed), the
  largest over the devices;
- the decoder is Megatron's block (q, k, v and the first MLP layer column-parallel, the attention
  output and the second MLP layer row-parallel, heads split), so tensor parallel shards everything
  but the norms and the residual stream; those live whole on the first device under tensor parallel
  alone, on sequence shards with it. A collective's output (an all-gathered column input) is one
  tensor on virtual devices, counted on the first device in both runs.
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
    """Pre-norm causal attention (q, k, v projections apart) and an MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([Block(d, heads) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def peak_activation_bytes(x: torch.Tensor, model: nn.Module, *, sequence_parallel: bool) -> int:
    pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh={"tp": 4}, sequence_parallel=sequence_parallel,
                             example_inputs=(x,))  # fmt: skip
    return max(dpcompile.measure(pm, x).step_allocated_peak.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/sequence_parallel.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Decoder()
    x = torch.randn(1, args.seq, 64)
    tp = peak_activation_bytes(x, model, sequence_parallel=False)
    sp = peak_activation_bytes(x, model, sequence_parallel=True)
    row = {"seq": args.seq, "batch": 1, "devices": 4, "layers": 4, "tp_peak_bytes": tp, "sp_peak_bytes": sp,
           "sp_over_tp": sp / tp}  # fmt: skip
    print(f"4-layer decoder, seq {args.seq} on 4 virtual devices: peak activation bytes per device: tensor "
          f"parallel {tp:,}, with sequence parallel {sp:,}: {sp / tp:.2f}x")  # fmt: skip
    if args.json:
        (RESULTS / "sequence_parallel.json").write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
