"""What does FSDP in one process cost against replication, and what does it store?

    python benchmarks/bench_fsdp_one_process.py [--rounds 9] [--quick]

For each layout (dp 2, dp 2 x tp 2, pp 2 x dp 2 on virtual CPU devices) an MLP (4 blocks,
d=256) trains with AdamW under ``data_parallel="fsdp"`` and under replication, in alternation in
one process: the step-time ratio fsdp / replicate (medians of interleaved rounds), and the
parameter bytes the fullest device stores (``explain``) as a ratio fsdp / replicate (1 / dp
expected; gradients and AdamW's state follow the parameters). Results: results/fsdp_one_process.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, write_result  # noqa: E402

import dpcompile  # noqa: E402

LAYOUTS = {"dp2": ({"dp": 2}, 2), "dp2xtp2": ({"dp": 2, "tp": 2}, 4), "pp2xdp2": ({"pp": 2, "dp": 2}, 4)}


class Blocks(nn.Module):
    def __init__(self, d: int, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


def _step(pm, opt, x):
    def run():
        pm(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="d=64, 3 rounds")
    args = parser.parse_args()
    d, rounds = (64, 3) if args.quick else (256, args.rounds)
    torch.manual_seed(0)
    model = Blocks(d)
    x = torch.randn(32, d)
    out = {}
    for name, (layout, n) in LAYOUTS.items():
        programs = {kind: dpcompile.transform(copy.deepcopy(model), ["cpu"] * n, mesh=layout, data_parallel=kind)
                    for kind in ("ddp", "fsdp")}  # fmt: skip
        opts = {kind: torch.optim.AdamW(pm.parameters(), lr=1e-3) for kind, pm in programs.items()}
        steps = {kind: _step(programs[kind], opts[kind], x) for kind in programs}
        times = interleaved(steps, rounds=rounds)
        held = {kind: dpcompile.explain(pm, x).param_bytes for kind, pm in programs.items()}
        out[name] = {
            "step_seconds": times,
            "step_ratio_fsdp_over_replicate": round(times["fsdp"] / times["ddp"], 3),
            "param_bytes_per_device": held,
            "param_bytes_ratio": round(max(held["fsdp"].values()) / max(held["ddp"].values()), 3),
        }
        print(f"{name}: step {out[name]['step_ratio_fsdp_over_replicate']}x replication's; parameter bytes on the "
              f"fullest device {out[name]['param_bytes_ratio']}x (gradients and AdamW state follow the parameters)")
    print(write_result("fsdp_one_process", {"d": d, "rounds": rounds, "layouts": out}))


if __name__ == "__main__":
    main()
