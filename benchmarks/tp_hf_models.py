"""Tensor parallelism on the transformers people use, with the automatic plan on 2 devices (tiny
configs, random weights): GPT-2, BERT, Llama (grouped-query attention) and T5 from transformers
(captured by the export frontend), timm's ViT, torchvision's ViT and Swin (the fx frontend).

Per model: the share of the bytes of Linear-like and embedding parameters that are sharded, each
device's parameter bytes against total/N and against ``sharded / N + replicated``, the forward
collectives (all-reduce, all-gather) per transformer block counted from the generated program,
the ones outside blocks, and whether the output (and the loss, where the model computes it) equals
eager. Writes results/tp_hf_models.json.

    python benchmarks/tp_hf_models.py
"""

from __future__ import annotations

import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

import dpcompile  # noqa: E402
from tests.thirdparty import define_torchvision_ops  # noqa: E402

DEVICES = ["cpu"] * 2
COLLECTIVES = {"reduce_to_device": "all_reduce", "gather_to_device": "all_gather"}


def models(ids: torch.Tensor) -> dict:
    """name -> (model, kwargs, block pattern of node names)."""
    define_torchvision_ops()
    import timm
    import torchvision
    import transformers as T

    image = torch.randn(2, 3, 32, 32)
    return {
        "gpt2 (labels=: vocab-parallel loss)": (
            T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)),
            {"input_ids": ids, "labels": ids}, r"transformer_h_(\d+)_"),
        "bert": (T.BertModel(T.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=128)),
                 {"input_ids": ids}, r"encoder_layer_(\d+)_"),
        "llama (GQA 4/2 heads, labels=)": (
            T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=128)),
            {"input_ids": ids, "labels": ids}, r"model_layers_(\d+)_"),
        "t5": (T.T5ForConditionalGeneration(T.T5Config(num_layers=1, num_decoder_layers=1, d_model=64, d_kv=16,
                                                        num_heads=4, d_ff=128, vocab_size=128,
                                                        decoder_start_token_id=0)),
               {"input_ids": ids, "decoder_input_ids": ids}, r"((?:en|de)coder_block_\d+)_"),
        "timm vit_tiny (4 heads)": (
            timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=10, num_heads=4), {"x": image}, r"blocks_(\d+)_"),
        "torchvision ViT": (
            torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                 hidden_dim=64, mlp_dim=128),
            {"x": image}, r"encoder_layers_encoder_layer_(\d+)_"),
        "torchvision Swin": (
            torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                               window_size=[4, 4], stochastic_depth_prob=0.0),
            {"x": image}, r"features_(\d+_\d+)_"),
    }  # fmt: skip


def linear_like(model: nn.Module) -> list[torch.Tensor]:
    """The parameters of Linear-like layers and embeddings, each once (a tied weight counts once)."""
    conv1d = tuple(type(m) for m in model.modules() if type(m).__name__ == "Conv1D")
    kinds = (nn.Linear, nn.Embedding, nn.MultiheadAttention, *conv1d)
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for path, m in model.named_modules():
        if isinstance(m, kinds):
            for name, p in m.named_parameters(recurse=False):
                seen.setdefault(id(p), (f"{path}.{name}" if path else name, p))
    return list(seen.values())


def collectives_per_block(pm, pattern: str) -> tuple[dict[str, Counter], Counter]:
    """Forward collectives by transformer block (from node names), and those outside any block."""
    blocks: dict[str, Counter] = {}
    outside: Counter = Counter()
    for node in pm.graph.nodes:
        match = re.match(pattern, node.name)
        if match:
            blocks.setdefault(match.group(1), Counter())
        kind = COLLECTIVES.get(getattr(node.target, "__name__", "")) if node.op == "call_function" else None
        if kind:
            (blocks[match.group(1)] if match else outside)[kind] += 1
    return blocks, outside


def measure(model: nn.Module, kwargs: dict, pattern: str) -> dict:
    model.eval()
    pm = dpcompile.transform(model, DEVICES, tensor_parallel=True, example_kwargs=kwargs)
    nbytes = lambda p: p.numel() * p.element_size()  # noqa: E731
    matrices = linear_like(model)
    sharded_keys = set(pm.param_shards)
    total_ll = sum(nbytes(p) for _, p in matrices)
    sharded_ll = sum(nbytes(p) for k, p in matrices if k in sharded_keys)
    unique = {id(p): (k, p) for k, p in model.named_parameters()}.values()
    total = sum(nbytes(p) for _, p in unique)
    shard_bytes = sum(nbytes(p) for k, p in unique if k in sharded_keys or any(
        k2 in sharded_keys for k2, p2 in model.named_parameters(remove_duplicate=False) if p2 is p))  # fmt: skip
    ideal = shard_bytes / len(DEVICES) + (total - shard_bytes)
    per_device = max(pm.param_bytes_per_slot().values())
    blocks, outside = collectives_per_block(pm, pattern)
    with torch.no_grad():
        ours, eager = pm(**kwargs), model(**kwargs)
    first = lambda o: o if isinstance(o, torch.Tensor) else next(  # noqa: E731
        getattr(o, a) for a in ("logits", "last_hidden_state") if getattr(o, a, None) is not None)
    equal = torch.allclose(first(ours), first(eager), atol=1e-4)
    if getattr(eager, "loss", None) is not None:
        equal = equal and torch.allclose(ours.loss, eager.loss, atol=1e-5)
    whole = {p: why for p, why in pm.plan_reasons.items() if pm.plan.get(p) == "replicate"}
    return {
        "sharded_fraction_of_linear_like_bytes": round(sharded_ll / total_ll, 4),
        "param_bytes_total": total,
        "total_over_n": total // len(DEVICES),
        "ideal_per_device": round(ideal),
        "max_per_device": per_device,
        "per_device_vs_total_over_n_pct": round(100 * (per_device / (total / len(DEVICES)) - 1), 1),
        "blocks": len(blocks),
        "all_reduce_per_block": [blocks[b]["all_reduce"] for b in blocks],
        "all_gather_per_block": [blocks[b]["all_gather"] for b in blocks],
        "collectives_outside_blocks": dict(outside),
        "equal_to_eager": bool(equal),
        "left_whole": whole,
    }


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8))
    results = {name: measure(*spec) for name, spec in models(ids).items()}
    print(f"{'model':36} {'sharded':>8} {'per dev':>9} {'total/N':>9} {'ideal':>9}  all-reduce/block  all-gather/block  equal")
    for name, r in results.items():
        print(f"{name:36} {100 * r['sharded_fraction_of_linear_like_bytes']:7.1f}% {r['max_per_device']:9,} "
              f"{r['total_over_n']:9,} {r['ideal_per_device']:9,}  {r['all_reduce_per_block']!s:16}  "
              f"{r['all_gather_per_block']!s:16}  {r['equal_to_eager']}")  # fmt: skip
    write_result("tp_hf_models", {"devices": DEVICES, "models": results})


if __name__ == "__main__":
    main()
