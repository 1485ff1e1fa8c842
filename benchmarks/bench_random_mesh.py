"""What does ``exact_random=True`` (the default) cost over a gloo ``DeviceMesh``?

    python benchmarks/bench_random_mesh.py

GPT-2 (transformers, random weights: 4 layers, 256 wide, 4 heads, vocab 2048, its default dropout
0.1) exported with ``labels=``, one training step per layout over 2 gloo processes on CPU (one
thread each), batch 8 x 64 tokens globally (4 x 64 per rank on ``dp``):

- ``exact_s``: every rank draws each site's whole tensor and keeps its slice (``pp``: each rank
  also draws the other stage's sites, to leave its generator where eager's is);
- ``per_rank_s``: ``exact_random=False``, each rank draws its own piece;
- ``ratio`` = exact / per-rank, medians of rounds run in alternation; rank 0's times.

Results: results/random_mesh.json.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from bench_random import BATCH, SEQ, gpt2  # noqa: E402
from common import interleaved, write_result  # noqa: E402

LAYOUTS = {"dp": ({"dp": 2}, {}), "tp": ({"tp": 2}, {"tensor_parallel": True}),
           "pp": ({"pp": 2}, {"pipeline": 2, "micro_batches": 2})}  # fmt: skip


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.capture import capture_model

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    model, kwargs = gpt2()
    rows = {}
    for name, (layout, options) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=tuple(layout))
        local = {k: v[rank * BATCH // 2 : (rank + 1) * BATCH // 2] for k, v in kwargs.items()} if "dp" in layout else kwargs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = capture_model(model, frontend="export", example_kwargs=local)[0]
            built = {mode: dpcompile.transform(program, mesh, example_kwargs=local, exact_random=mode == "exact", **options)
                     for mode in ("exact", "per_rank")}  # fmt: skip

        def step(pm, local=local, pipelined=("pp" in layout)):
            def run():
                out = pm(**local)
                if not pipelined:  # a pipeline's call runs its backward itself
                    out.loss.backward()
                pm.zero_grad(set_to_none=True)

            return run

        times = interleaved({mode: step(pm) for mode, pm in built.items()}, rounds=7)
        rows[name] = {"exact_s": times["exact"], "per_rank_s": times["per_rank"], "ratio": times["exact"] / times["per_rank"]}
    results.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    from tests.gloo_groups import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    rows = by_rank[0]
    for name, row in rows.items():
        print(f"{name:3s} exact {row['exact_s'] * 1e3:8.1f} ms  per-rank {row['per_rank_s'] * 1e3:8.1f} ms  "
              f"ratio {row['ratio']:.3f}")  # fmt: skip
    path = write_result("random_mesh", {"model": f"GPT-2 4x256, global batch {BATCH}x{SEQ}, dropout 0.1",
                                        "processes": "2 gloo ranks on CPU", "threads": 1, "layouts": rows})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
