"""What does ``exact_random=True`` (the default) cost against per-device draws?

    python benchmarks/bench_random.py

GPT-2 (transformers, random weights from a small config: 4 layers, 256 wide, 4 heads, vocab 2048,
its default dropout 0.1 on embeddings, attention probabilities and residuals) through the export
frontend with ``labels=``, batch 8 x 64 tokens, one training step (forward and backward) per layout
on virtual CPU devices:

- ``exact_s``: ``transform(..., exact_random=True)``: each random site draws its whole tensor once
  and each device takes its slice (attention dropout runs the SDPA math kernel written out);
- ``per_device_s``: ``transform(..., exact_random=False)``: each device draws its own piece;
- ``ratio`` = exact / per-device (the goal: <= 1.05).

Both programs built from one exported program, measured in alternation (median of rounds).
Results: results/random.json.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.capture import capture_model  # noqa: E402

LAYOUTS = {"dp": {"mesh": {"dp": 2}}, "tp": {"mesh": {"tp": 2}}, "pp": {"mesh": {"pp": 2}, "micro_batches": 2}}
BATCH, SEQ, VOCAB = 8, 64, 2048


def gpt2():
    from tests.thirdparty import define_torchvision_ops

    define_torchvision_ops()  # transformers imports torchvision, a CUDA build here
    import transformers as T

    config = T.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": ids}


def step(pm, kwargs):
    def run():
        pm(**kwargs).loss.backward()
        pm.zero_grad(set_to_none=True)

    return run


def main() -> None:
    torch.set_num_threads(1)
    model, kwargs = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = capture_model(model, frontend="export", example_kwargs=kwargs)[0]
    rows = {}
    for name, layout in LAYOUTS.items():
        devices = ["cpu"] * 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exact = dpcompile.transform(program, devices, example_kwargs=kwargs, exact_random=True, **layout)
            per_device = dpcompile.transform(program, devices, example_kwargs=kwargs, exact_random=False, **layout)
        assert "exact_dropout" in exact.code and "exact_dropout" not in per_device.code
        times = interleaved({"exact": step(exact, kwargs), "per_device": step(per_device, kwargs)}, rounds=9)
        rows[name] = {"exact_s": times["exact"], "per_device_s": times["per_device"],
                      "ratio": times["exact"] / times["per_device"]}  # fmt: skip
        print(f"{name:3s} exact {times['exact'] * 1e3:8.1f} ms  per-device {times['per_device'] * 1e3:8.1f} ms  "
              f"ratio {rows[name]['ratio']:.3f}")  # fmt: skip
    path = write_result("random", {"model": f"GPT-2 4x256, batch {BATCH}x{SEQ}, dropout 0.1", "devices": "2 virtual CPU",
                                   "threads": 1, "layouts": rows})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
