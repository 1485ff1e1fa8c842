"""What ``plan="auto"`` over a DeviceMesh adds to ``transform``: the seconds of
``transform(model, mesh, plan="auto", ...)`` against ``transform(model, dp_mesh)`` (the layout it
chooses here, named), alternated in the same gloo processes, ``--repeats`` each; the ratio of the
medians. The reference calibration (``DPCOMPILE_CALIBRATION=off``): planning, not measuring.

    PYTHONPATH=. nice -n 5 python benchmarks/bench_planner_mesh.py [--world 2] [--repeats 5] [--layers 4]

Writes ``benchmarks/results/planner_mesh.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gloo_groups import run_spawned  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "planner_mesh.json"


def rank_main(rank: int, world: int, port: int, layers: int, repeats: int, results) -> None:  # noqa: ANN001
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from tests.integration.test_planner import Stack

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["DPCOMPILE_CALIBRATION"] = "off"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    torch.manual_seed(0)
    model = Stack(layers=layers, d=256)
    batch = (torch.randn(8, 64, 16), torch.randn(8, 64, 8))
    seconds: dict[str, list[float]] = {"named": [], "auto": []}
    chosen = None
    for r in range(repeats + 1):  # the first round warms up, not kept
        for kind in ("named", "auto") if r % 2 else ("auto", "named"):
            dist.barrier()
            start = time.perf_counter()
            if kind == "named":
                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
                dpcompile.transform(copy.deepcopy(model), mesh, example_inputs=batch)
            else:
                pm = dpcompile.transform(copy.deepcopy(model), init_device_mesh("cpu", (world,)), plan="auto",
                                         memory_per_device="1GiB", example_inputs=batch, optimizer="adamw")  # fmt: skip
                chosen = pm.layout
            dist.barrier()
            if r:
                seconds[kind].append(time.perf_counter() - start)
    results.put((rank, {"seconds": seconds, "chosen": chosen}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    ns = parser.parse_args()
    out = run_spawned(rank_main, ns.world, ns.layers, ns.repeats, timeout=900)
    report = out[0]
    named, auto = statistics.median(report["seconds"]["named"]), statistics.median(report["seconds"]["auto"])
    summary = {"chosen": report["chosen"], "named_dp_s": named, "auto_s": auto, "ratio_auto_to_named": auto / named}
    print(json.dumps(summary, indent=1))
    RESULTS.write_text(json.dumps({
        "command": "PYTHONPATH=. nice -n 5 python benchmarks/bench_planner_mesh.py " + " ".join(sys.argv[1:]),
        "world": ns.world, "layers": ns.layers, "repeats": ns.repeats, "cores": os.cpu_count(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "summary": summary, "seconds": report["seconds"],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
