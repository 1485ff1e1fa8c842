"""How do the tensor-parallel plans change because ops no sharding rule names ask their batch rule?

    PYTHONPATH=. python -m benchmarks.sharding_delegation_plans [MODEL ...]   # every model, or those named

For the models of the tensor-parallel tests (tiny GPT-2, Llama, BERT from transformers; the
suite's MLP, attention, norm-after-column, TinyGPT2, fused-chunk attention, causal attention and
the tied LM), builds the automatic plan on 2 and 3 virtual devices twice: as shipped (``apply_rule``
asks ``sharding_batch.from_batch_rule`` where no sharding rule names the op, and the planner's
``is_shard_transparent`` asks the same table) and with the sharding rules alone (both answers
switched off). Prints, per model, whether the plan, its reasons and the program's collectives
(all-gathers, all-reduces, copies, splits) are the same, and the differences where not, with the
elements the collectives move per call (``dpcompile.explain``: forward, backward).
"""

from __future__ import annotations

import collections
import re
import sys
import warnings

import torch

import dpcompile
from dpcompile.analysis import sharding_rules
from dpcompile.analysis.sharding_layout import NeedsWhole

# the tensor-parallel runtime's calls in the program: gathers, all-reduces, copies (f), splits
RUNTIME_CALL = re.compile(r"dpcompile_runtime_tensor_parallel_(\w+)\(")


def _models() -> dict[str, tuple[torch.nn.Module, dict]]:
    from tests import models, thirdparty_tp
    from tests.integration.test_context_parallel import CausalSelfAttention
    from tests.integration.test_training_checkpoint import batches, make_model

    out: dict[str, tuple[torch.nn.Module, dict]] = {
        "MLP": (models.MLP(), {"example_inputs": (torch.randn(4, 8),)}),
        "Attention": (models.Attention(), {"example_inputs": (torch.randn(2, 5, 16),)}),
        "NormAfterColumn": (models.NormAfterColumn(), {"example_inputs": (torch.randn(4, 8),)}),
        "TinyGPT2": (thirdparty_tp.TinyGPT2(), {"example_inputs": (torch.randint(0, 128, (2, 8)),)}),
        "FusedChunkAttention": (thirdparty_tp.FusedChunkAttention(), {"example_inputs": (torch.randn(2, 5, 12),)}),
        # q, k, v unpacked from a permuted fused qkv (``q, k, v = qkv.view(..).permute(2, 0, 3, 1, 4)``)
        "CausalSelfAttention": (CausalSelfAttention(), {"example_inputs": (torch.randn(2, 7, 16),)}),
        # cross_entropy(head(x).flatten(0, 1), labels.flatten()) after a tied, vocab-parallel head
        "TinyLM": (make_model(), {"example_inputs": batches()[0]}),
    }
    try:
        from tests.integration.test_tp_hf_megatron import _inputs, _model

        for name in ("gpt2", "llama", "bert"):
            out[f"hf-{name}"] = (_model(name).eval(), {"example_kwargs": _inputs(name)})
    except Exception as e:  # noqa: BLE001 - transformers missing: the suite's models only
        print("transformers models skipped:", type(e).__name__, e)
    return out


def _plan(model: torch.nn.Module, n: int, kwargs: dict) -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = dpcompile.transform(model, ["cpu"] * n, tensor_parallel=True, **kwargs)
        report = dpcompile.explain(pm, *kwargs.get("example_inputs", ()), **kwargs.get("example_kwargs", {}))
    counts = collections.Counter(RUNTIME_CALL.findall(pm.code))
    moved = (round(report.comm_elements_forward), round(report.comm_elements_backward))
    return dict(pm.plan), dict(pm.plan_reasons), dict(sorted(counts.items())), moved


def main(names: list[str]) -> int:
    delegated, transparent = sharding_rules.from_batch_rule, sharding_rules.keeps_last_dim_sharded

    def rules_alone(ctx, node, modules):  # the answer before the delegation: gathered first
        if node.op == "call_module":
            raise NeedsWhole(f"no sharding rule for {type(modules.get(node.target)).__name__}")
        raise NeedsWhole("needs the whole tensor")

    changed = 0
    for name, (model, kwargs) in _models().items():
        if names and name not in names:
            continue
        for n in (2, 3):
            try:
                with_delegation = _plan(model, n, kwargs)
                sharding_rules.from_batch_rule = rules_alone
                sharding_rules.keeps_last_dim_sharded = lambda node, modules: False
                without = _plan(model, n, kwargs)
            except Exception as e:  # noqa: BLE001
                print(f"{name:22s} n={n}: could not build ({type(e).__name__}: {e})")
                continue
            finally:
                sharding_rules.from_batch_rule, sharding_rules.keeps_last_dim_sharded = delegated, transparent
            same = with_delegation == without
            changed += not same
            print(f"{name:22s} n={n}: {'same plan, reasons and collectives' if same else 'CHANGED'} "
                  f"(collectives {with_delegation[2]}; elements moved forward, backward {with_delegation[3]})")  # fmt: skip
            if not same:
                for label, a, b in zip(("plan", "reasons", "collectives", "moved"), with_delegation, without):
                    if a != b:
                        print(f"    {label}: with delegation {a}\n    {' ' * len(label)}  without     {b}")
    print(f"{changed} model x devices changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
