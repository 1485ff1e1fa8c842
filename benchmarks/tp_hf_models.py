"""Tensor parallelism on transformers models captured by the export frontend (tiny configs,
random weights): the share of 2-D parameter bytes sharded, per-device parameter bytes against
total/N, and whether the output equals eager. Writes results/tp_hf_models.json.

    python benchmarks/tp_hf_models.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

import dpcompile  # noqa: E402
from tests.thirdparty import define_torchvision_ops  # noqa: E402

DEVICES = ["cpu"] * 2


def models(ids: torch.Tensor) -> dict:
    define_torchvision_ops()
    import transformers as T

    return {
        "gpt2": (T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)),
                 {"input_ids": ids}, lambda o: o.logits),
        "bert": (T.BertModel(T.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=128)),
                 {"input_ids": ids}, lambda o: o.last_hidden_state),
        "llama": (T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                   num_key_value_heads=4, intermediate_size=128, vocab_size=128)),
                  {"input_ids": ids}, lambda o: o.logits),
        "t5": (T.T5ForConditionalGeneration(T.T5Config(num_layers=1, num_decoder_layers=1, d_model=64, d_kv=16,
                                                        num_heads=4, d_ff=128, vocab_size=128,
                                                        decoder_start_token_id=0)),
               {"input_ids": ids, "decoder_input_ids": ids}, lambda o: o.logits),
    }  # fmt: skip


def measure(model: torch.nn.Module, kwargs: dict, output) -> dict:
    model.eval()
    pm = dpcompile.transform(model, DEVICES, tensor_parallel=True, example_kwargs=kwargs)
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    total_2d = sum(p.numel() * p.element_size() for _, p in matrices)
    sharded = sum(p.numel() * p.element_size() for n, p in matrices if n in pm.param_shards)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        equal = torch.allclose(output(pm(**kwargs)), output(model(**kwargs)), atol=1e-4)
    return {
        "sharded_fraction_of_2d_bytes": round(sharded / total_2d, 4),
        "per_device_bytes": pm.param_bytes_per_slot()[0],
        "total_over_n": total // len(DEVICES),
        "equal_to_eager": equal,
    }


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8))
    results = {name: measure(*spec) for name, spec in models(ids).items()}
    for name, r in results.items():
        print(f"{name:6s} sharded {r['sharded_fraction_of_2d_bytes']:.2f} of 2-D bytes; per device "
              f"{r['per_device_bytes']} vs total/N {r['total_over_n']}; equal to eager: {r['equal_to_eager']}")
    write_result("tp_hf_models", {"devices": DEVICES, "models": results})


if __name__ == "__main__":
    main()
