"""A 1 B-parameter Llama built on meta, tensor parallel over 4 virtual devices, loaded from safetensors.

    python benchmarks/bench_big_model.py [--layers 22] [--hidden 2048] [--dir /tmp/dpcompile_big_model]

Three steps, each in a fresh process so that one's memory never counts in another's:

1. **write**: the checkpoint, in transformers' sharded layout (``model-0000k-of-0000n.safetensors``
   files of at most ``--shard-mb`` MB and the index json), tensor by tensor from a seeded
   generator (``dpcompile.checkpoint.write_safetensors``): one tensor in memory at a time.
2. **tensor parallel**: ``LlamaForCausalLM`` built under ``torch.device("meta")`` from its config,
   ``dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True)``, ``dpcompile.load_checkpoint``,
   one forward. Reports transform and load time, the process's peak resident memory
   (``getrusage`` ``ru_maxrss``, and a 20 ms ``/proc/self/status`` sampler for the anonymous
   part) against the checkpoint's size (goal ≤ 1.15×; a full model plus its shards would be
   ≥ 2×), and the parameter bytes each device holds against total / 4.
3. **eager**: the same model, eager, its parameters assigned from the same files (buffers real,
   parameters on meta until assigned), one forward: the reference, in its own process (it
   is as big as the checkpoint).

The logits of 2 and 3 are compared (the full model, the same input). Results:
``results/big_model.json``. The checkpoint folder is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import write_result  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.checkpoint import write_safetensors  # noqa: E402
from dpcompile.checkpoint.buffers import parameters_on_meta  # noqa: E402
from dpcompile.checkpoint.files import INDEX_FILE, plan_files, shard_file_name  # noqa: E402
from tests.thirdparty import define_torchvision_ops  # noqa: E402

SEQUENCE = 16


def config(args: argparse.Namespace):
    define_torchvision_ops()
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False, attn_implementation="eager",
    )  # fmt: skip


def model_on_meta(args: argparse.Namespace):
    define_torchvision_ops()
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config(args)).eval()


def input_ids(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (1, SEQUENCE), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------- 1. write
def write(args: argparse.Namespace) -> dict:
    """The checkpoint, tensor by tensor: norms near 1, the rest N(0, 0.02), each from its own seed."""
    model = model_on_meta(args)
    shapes = {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict().items()}
    seeds = {key: k for k, key in enumerate(shapes)}

    def make(key: str) -> torch.Tensor:
        shape, dtype = shapes[key]
        g = torch.Generator().manual_seed(seeds[key])
        value = torch.randn(shape, generator=g, dtype=dtype) * 0.02
        return value + 1.0 if key.endswith("norm.weight") else value

    sizes = [(key, int(torch.Size(shape).numel()) * dtype.itemsize) for key, (shape, dtype) in shapes.items()]
    groups = plan_files(sizes, args.shard_mb * 10**6)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    started = time.perf_counter()
    for k, keys in enumerate(groups):
        name = shard_file_name(k, len(groups))
        write_safetensors(folder / name, [(key, *shapes[key]) for key in keys], make)
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(size for _, size in sizes)
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    parameters = sum(torch.Size(shape).numel() for shape, _ in shapes.values())
    return {
        "checkpoint_bytes": total,
        "files": len(groups),
        "parameters": parameters,
        "write_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------- 2. tensor parallel
class PeakMemory:
    """The largest resident anonymous memory (``RssAnon``) of this process, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, anon_bytes())
            time.sleep(0.02)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_anon = max(self.peak_anon, anon_bytes())


def anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def tensor_parallel(args: argparse.Namespace) -> dict:
    ids = input_ids(args)
    model = model_on_meta(args)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before_anon = anon_bytes()
    with PeakMemory() as peak:
        started = time.perf_counter()
        pm = dpcompile.transform(model, ["cpu"] * 4, tensor_parallel=True, example_kwargs={"input_ids": ids})
        transform_s = time.perf_counter() - started
        started = time.perf_counter()
        dpcompile.load_checkpoint(pm, args.dir)
        load_s = time.perf_counter() - started
        with torch.no_grad():
            logits = pm(input_ids=ids).logits
    torch.save(logits, Path(args.dir) / "tp_logits.pt")
    per_slot = pm.param_bytes_per_slot()
    sharded = {name for _, names in pm.param_shards.values() for name in names}
    shard_bytes = sum(p.numel() * p.element_size() for n, p in pm.named_parameters() if n in sharded)
    return {
        "transform_s": transform_s,
        "load_s": load_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_transform_bytes": before_rss,
        "peak_anon_bytes": peak.peak_anon,
        "anon_before_transform_bytes": before_anon,
        "param_bytes_per_device": per_slot,
        "sharded_param_bytes": shard_bytes,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
    }


# ---------------------------------------------------------------------------- 3. eager
def eager(args: argparse.Namespace) -> dict:
    define_torchvision_ops()
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    with parameters_on_meta():  # buffers (rotary inv_freq) real, parameters assigned from the files
        model = LlamaForCausalLM(config(args)).eval()
    files = sorted(set(json.loads((Path(args.dir) / INDEX_FILE).read_text())["weight_map"].values()))
    for name in files:
        model.load_state_dict(load_file(str(Path(args.dir) / name)), strict=False, assign=True)
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        logits = model(input_ids=input_ids(args)).logits
    torch.save(logits, Path(args.dir) / "eager_logits.pt")
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


STEPS = {"write": write, "tensor_parallel": tensor_parallel, "eager": eager}


def run_step(step: str, argv: list[str]) -> dict:
    """``step`` in a fresh Python process; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, __file__, "--step", step, *argv], check=True, capture_output=True, text=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--dir", default="/tmp/dpcompile_big_model")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--step", choices=sorted(STEPS))
    args = parser.parse_args()
    if args.step:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        print(json.dumps(STEPS[args.step](args)))
        return
    argv = [a for a in sys.argv[1:] if a != "--keep"]
    try:
        written = run_step("write", argv)
        tp = run_step("tensor_parallel", argv)
        reference = run_step("eager", argv)
        got = torch.load(Path(args.dir) / "tp_logits.pt")
        want = torch.load(Path(args.dir) / "eager_logits.pt")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    size = written["checkpoint_bytes"]
    per_device = {int(k): v for k, v in tp["param_bytes_per_device"].items()}
    result = {
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dtype": "float32",
            "parameters": written["parameters"],
        },
        "devices": ["cpu"] * 4,
        "checkpoint": {
            "bytes": size,
            "files": written["files"],
            "shard_mb": args.shard_mb,
            "write_s": written["write_s"],
        },
        "transform_s": tp["transform_s"],
        "load_s": tp["load_s"],
        "peak_rss_bytes": tp["peak_rss_bytes"],
        "peak_rss_over_checkpoint": tp["peak_rss_bytes"] / size,
        "rss_before_transform_bytes": tp["rss_before_transform_bytes"],
        "peak_rss_growth_over_checkpoint": (tp["peak_rss_bytes"] - tp["rss_before_transform_bytes"]) / size,
        "peak_anon_bytes": tp["peak_anon_bytes"],
        "peak_anon_over_checkpoint": tp["peak_anon_bytes"] / size,
        "param_bytes_per_device": per_device,
        "param_bytes_per_device_over_total_div_4": {k: v / (size / 4) for k, v in per_device.items()},
        "parameter_bytes_held": tp["parameter_bytes"],
        "sharded_share_of_parameters": tp["sharded_param_bytes"] / tp["parameter_bytes"],
        "eager_reference": "the full model, eager, in its own process (same files, same input ids (1, 16))",
        "eager_peak_rss_bytes": reference["peak_rss_bytes"],
        "logits_max_abs_diff": float((got - want).abs().max()),
        "logits_close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)),
    }
    path = write_result("big_model", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
