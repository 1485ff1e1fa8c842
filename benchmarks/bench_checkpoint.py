"""Training checkpoints of a large model with AdamW state over 4 virtual devices: memory and time, as ratios.

    python benchmarks/bench_checkpoint.py [--params 250e6] [--hidden 1024] [--tmp DIR]

A stack of MLP blocks (``Linear(h, 4h)``, GELU, ``Linear(4h, h)``, residual) between an embedding and
an LM head, float32, sized to ``--params`` parameters, built on meta and made tensor parallel over
4 virtual CPU devices (each device allocates only its shards), its shards filled from a seeded
generator, and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) on every parameter. Each
operation runs in a fresh process, measured from the moment the program and its optimizer are
built: the peak resident memory it adds (``VmHWM`` reset through ``/proc/self/clear_refs`` before
it), the memory the program holds after it, and its seconds. In the same run:

* ``save``: ``dpcompile.save_checkpoint(pm, dir, optimizer=opt)`` (safetensors; each sharded
  tensor written as the runs of its shards' bytes) against ``torch.save({"model":
  pm.state_dict(), "optimizer": opt.state_dict()})`` (the program's state dict puts every
  sharded tensor together);
* ``load``: ``dpcompile.load_checkpoint(pm, dir, optimizer=opt)`` into a fresh program (each
  piece read as its slice) against ``torch.load`` of that file and ``load_state_dict`` of both;
* ``dcp_save`` / ``dcp_load``: the same with ``format="dcp"``.

Reported: time over torch's; the peak memory an operation adds beyond what the program holds
(before a save, after a load) over the largest piece (the largest tensor one device holds) and
over the largest device's share (its parameters and their AdamW state). Nothing gathered means
a few pieces at most; torch's way puts the whole model together. Results:
``results/checkpoint.json``; the files go to a temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from common import write_result  # noqa: E402

import dpcompile  # noqa: E402
from dpcompile.modules.weights import weights_loaded  # noqa: E402

DEVICES = 4
VOCAB = 8192
OPERATIONS = ["save", "torch_save", "load", "torch_load", "dcp_save", "dcp_load"]


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Big(nn.Module):
    def __init__(self, h: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.head = nn.Linear(h, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layers_for(params: float, h: int) -> int:
    return max(1, round((params - 2 * VOCAB * h) / (8 * h * h + 5 * h)))


def build(h: int, layers: int, with_state: bool):
    """The program (tensor parallel over 4 virtual devices, built on meta, shards filled) and AdamW."""
    with torch.device("meta"):
        model = Big(h, layers)
    pm = dpcompile.transform(model, ["cpu"] * DEVICES, tensor_parallel=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pm.parameters():
            p.normal_(0, 0.02, generator=g)
    weights_loaded(pm)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    if with_state:
        for p in pm.parameters():
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.empty_like(p).normal_(generator=g),
                "exp_avg_sq": torch.empty_like(p).uniform_(generator=g),
            }
    return pm, opt


def _status(field: str) -> int:
    """Bytes of ``VmRSS`` / ``VmHWM`` of this process."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def run_operation(name: str, h: int, layers: int, folder: Path) -> dict:
    """One operation in this (fresh) process: its seconds and memory."""
    pm, opt = build(h, layers, with_state=name.endswith("save"))
    pieces = [p.numel() * p.element_size() for p in pm.parameters()]
    per_device = pm.param_bytes_per_slot()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    start = time.perf_counter()
    if name == "save":
        dpcompile.save_checkpoint(pm, folder / "safetensors", optimizer=opt)
    elif name == "dcp_save":
        dpcompile.save_checkpoint(pm, folder / "dcp", optimizer=opt, format="dcp")
    elif name == "torch_save":
        torch.save({"model": pm.state_dict(), "optimizer": opt.state_dict()}, folder / "torch.pt")
    elif name == "load":
        dpcompile.load_checkpoint(pm, folder / "safetensors", optimizer=opt)
    elif name == "dcp_load":
        dpcompile.load_checkpoint(pm, folder / "dcp", optimizer=opt)
    elif name == "torch_load":
        state = torch.load(folder / "torch.pt", weights_only=True)
        pm.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        del state
    seconds = time.perf_counter() - start
    peak, after = _status("VmHWM"), _status("VmRSS")
    held = after if name.endswith("load") else before  # the program's own: after a load it holds the state too
    return {
        "seconds": seconds,
        "rss_before": before,
        "rss_after": after,
        "peak": peak,
        "peak_over_held": max(0, peak - held),
        "largest_piece": max(pieces) if pieces else 0,
        "largest_device": 3 * max(per_device.values()),  # parameters and their AdamW moments
        "parameters": sum(p.numel() for p in pm.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=250e6, help="parameters of the model (about)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tmp", default=None, help="where the checkpoints are written (a temporary folder in it)")
    parser.add_argument("--operation", choices=OPERATIONS, help=argparse.SUPPRESS)  # one operation, in its own process
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers = layers_for(args.params, args.hidden)
    if args.operation:
        print(json.dumps(run_operation(args.operation, args.hidden, layers, Path(args.folder))))
        return
    folder = Path(tempfile.mkdtemp(prefix="dpcompile_bench_checkpoint_", dir=args.tmp))
    results: dict[str, dict] = {}
    try:
        for name in OPERATIONS:  # the saves first: each load reads what its save wrote
            command = [sys.executable, __file__, "--operation", name, "--folder", str(folder),
                       "--params", str(args.params), "--hidden", str(args.hidden)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:>10}: {results[name]['seconds']:7.1f} s, peak over the program's own "
                  f"{results[name]['peak_over_held'] / 2**20:8.0f} MiB", flush=True)  # fmt: skip
        sizes = {f.name: f.stat().st_size for f in folder.rglob("*") if f.is_file()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    piece, device = results["save"]["largest_piece"], results["save"]["largest_device"]
    ratios = {
        "save_time_over_torch_save": results["save"]["seconds"] / results["torch_save"]["seconds"],
        "load_time_over_torch_load": results["load"]["seconds"] / results["torch_load"]["seconds"],
        "dcp_save_time_over_torch_save": results["dcp_save"]["seconds"] / results["torch_save"]["seconds"],
        "dcp_load_time_over_torch_load": results["dcp_load"]["seconds"] / results["torch_load"]["seconds"],
    }
    for name in OPERATIONS:
        ratios[f"{name}_peak_over_largest_piece"] = results[name]["peak_over_held"] / piece
        ratios[f"{name}_peak_over_largest_device"] = results[name]["peak_over_held"] / device
    payload = {
        "parameters": results["save"]["parameters"],
        "hidden": args.hidden,
        "layers": layers,
        "devices": DEVICES,
        "checkpoint_bytes": sum(v for k, v in sizes.items() if k.endswith(".safetensors")),
        "torch_save_bytes": sizes.get("torch.pt"),
        "ratios": ratios,
        "operations": results,
    }
    path = write_result("checkpoint", payload)
    print(json.dumps(ratios, indent=1))
    print(f"written {path}")


if __name__ == "__main__":
    main()
