"""Context parallel's attention gathered again in backward (``regather_keys_values``) against the same
program with its attention on keys and values gathered once and kept (the pass undone): the step time
(forward and backward) of a 2-layer causal decoder on 4 virtual devices, as a ratio measured in one run,
alternating, median of ``--repeats``.

    PYTHONPATH=. python benchmarks/bench_context_parallel_time.py [--seq 2048] [--repeats 5]

``is_causal``: the two-block causal kernel (no padded queries) against the padded one; ``mask``: an
explicit causal mask, whose attention backward runs again (one more attention forward per layer).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import dpcompile
from benchmarks.bench_context_parallel import Block, Decoder
from dpcompile import runtime


class MaskedBlock(Block):
    """The same block with an explicit causal mask instead of ``is_causal=True``."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = (torch.arange(s)[:, None] >= torch.arange(s)[None, :])[None, None]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def gathered_once(pm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``pm`` whose attention calls read keys and values gathered once (what the lowering wrote)."""
    gm = copy.deepcopy(pm)
    graph = gm.graph
    for node in [n for n in graph.nodes if n.target is runtime.attention_regathered]:
        query, key_shards, value_shards, dim, device, positions = node.args
        with graph.inserting_before(node):
            keys = graph.call_function(runtime.gather_sequence, (key_shards, dim, device))
            values = graph.call_function(runtime.gather_sequence, (value_shards, dim, device))
        if positions is None:
            node.target, node.args = F.scaled_dot_product_attention, (query, keys, values)
        else:
            node.target, node.args = runtime.causal_attention, (query, keys, values, positions)
    gm.recompile()
    return gm


def step_seconds(pm: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    pm(x).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(1, args.seq, 64)
    for name, block in (("is_causal", Block), ("mask", MaskedBlock)):
        model = Decoder(layers=2)
        model.layers = nn.ModuleList([block(64, 4) for _ in range(2)])
        pm = dpcompile.transform(copy.deepcopy(model), ["cpu"] * 4, mesh={"cp": 4}, example_inputs=(x,))
        before = gathered_once(pm)
        new, old = [], []
        for _ in range(args.repeats):
            new.append(step_seconds(pm, x))
            old.append(step_seconds(before, x))
        a, b = sorted(new)[len(new) // 2], sorted(old)[len(old) // 2]
        print(f"{name}, seq {args.seq}: step time gathered again in backward / gathered once: {a / b:.2f}x "
              f"({a * 1e3:.0f} ms / {b * 1e3:.0f} ms, median of {args.repeats})")  # fmt: skip


if __name__ == "__main__":
    main()
