"""How much of a transformer tensor parallelism shards, with the automatic plan.

For each model (small configs, random weights): the share of the bytes of Linear-like and
embedding parameters that are sharded, each device's parameter bytes against
``sharded / N + replicated``, and the forward collectives per transformer block, counted from
the generated program. Writes ``benchmarks/results/tp_transformers.json``.

    python benchmarks/tp_transformers_table.py [--devices 2]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import dpcompile  # noqa: E402
from tests.thirdparty_tp import TinyGPT2, conv1d, import_vision  # noqa: E402

COLLECTIVES = ("reduce_to_device", "gather_to_device")


class _Call(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)


def models():
    import_vision()
    import timm
    import torchvision

    yield (
        "gpt2-style (Conv1D, tied head)",
        TinyGPT2(vocab=512, d=64, heads=4, layers=2),
        (torch.randint(0, 512, (2, 16)),),
        "h.{}",
        2,
    )
    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10
    )
    yield "timm vit_tiny (3 heads, depth 2)", _Call(vit), (torch.randn(2, 3, 32, 32),), "m.blocks.{}", 2
    vit4 = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10, num_heads=4
    )
    yield "timm vit_tiny (4 heads, depth 2)", _Call(vit4), (torch.randn(2, 3, 32, 32),), "m.blocks.{}", 2
    tv = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )
    yield "torchvision ViT", tv, (torch.randn(2, 3, 32, 32),), "encoder.layers.encoder_layer_{}", 2
    swin = torchvision.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4], stochastic_depth_prob=0.0
    )
    yield "torchvision Swin", swin, (torch.randn(2, 3, 32, 32),), "features.1.{}", 2


def measure(name, model, inputs, block, blocks, n):
    pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=True, example_inputs=inputs)
    kinds = (nn.Linear, nn.Embedding, nn.MultiheadAttention, conv1d())
    seen, total, sharded = set(), 0, 0
    for path, m in model.named_modules():
        if isinstance(m, kinds):
            for pname, p in m.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
                    sharded += p.numel() * p.element_size() * (f"{path}.{pname}" in pm.param_shards)
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_bytes = sum({id(p): p.numel() * p.element_size() for k, p in model.named_parameters(remove_duplicate=False)
                       if k in pm.param_shards}.values())  # fmt: skip
    ideal = shard_bytes / n + (all_bytes - shard_bytes)
    per_slot = pm.param_bytes_per_slot()
    per_block = []
    for b in range(blocks):
        prefix = block.format(b).replace(".", "_") + "_"
        per_block.append(
            {
                c: sum(1 for node in pm.graph.nodes if node.op == "call_function" and c in getattr(node.target, "__name__", "")
                       and node.name.startswith(prefix))
                for c in COLLECTIVES
            }
        )  # fmt: skip
    return {
        "model": name,
        "devices": n,
        "sharded_bytes_pct": round(100 * sharded / total, 1),
        "param_bytes_total": all_bytes,
        "total_over_n": round(all_bytes / n),
        "ideal_per_device": round(ideal),
        "max_per_device": max(per_slot.values()),
        "per_device_vs_ideal_pct": round(100 * (max(per_slot.values()) / ideal - 1), 1),
        "all_reduce_per_block": [b["reduce_to_device"] for b in per_block],
        "all_gather_per_block": [b["gather_to_device"] for b in per_block],
        "outputs_equal": bool(torch.allclose(pm(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [measure(*spec, args.devices) for spec in models()]
    header = f"{'model':34} {'sharded':>8} {'per device':>11} {'ideal':>9} {'total/N':>9} {'vs ideal':>8}  all-reduce/block  all-gather/block"
    print(header)
    for r in rows:
        print(
            f"{r['model']:34} {r['sharded_bytes_pct']:7.1f}% {r['max_per_device']:11,} {r['ideal_per_device']:9,} "
            f"{r['total_over_n']:9,} {r['per_device_vs_ideal_pct']:+7.1f}%  {r['all_reduce_per_block']!s:16}  {r['all_gather_per_block']}"
        )
    out = pathlib.Path(__file__).parent / "results" / "tp_transformers.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
