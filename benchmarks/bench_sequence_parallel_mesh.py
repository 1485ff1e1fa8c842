"""The row layer's reduce-scatter over 2 gloo ranks: ``reduce_scatter`` (the backend's own) against
``reduce_scatter_by_all_reduce`` (an all-reduce, each rank keeping its slice), forward and backward,
interleaved in one run; the ratio of their median times.

    PYTHONPATH=. python benchmarks/bench_sequence_parallel_mesh.py [--seq 1024] [--d 1024] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tests.gloo_groups import run_spawned


def _rank(rank: int, world: int, port: int, seq: int, d: int, repeats: int, results) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from dpcompile.runtime import sequence_mesh

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    x = torch.randn(4, seq, d, requires_grad=True)
    times: dict[str, list[float]] = {"reduce_scatter": [], "reduce_scatter_by_all_reduce": []}
    for _ in range(repeats + 2):  # the first two: warm-up
        for name in times:
            dist.barrier()
            start = time.perf_counter()
            getattr(sequence_mesh, name)(x, None, 1).sum().backward()
            times[name].append(time.perf_counter() - start)
    results.put((rank, {name: statistics.median(t[2:]) for name, t in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    outcomes = run_spawned(_rank, 2, args.seq, args.d, args.repeats, timeout=600)
    for rank, medians in sorted(outcomes.items()):
        ratio = medians["reduce_scatter_by_all_reduce"] / medians["reduce_scatter"]
        print(f"rank {rank}: reduce_scatter {medians['reduce_scatter'] * 1e3:.1f} ms, all-reduce then slice "
              f"{medians['reduce_scatter_by_all_reduce'] * 1e3:.1f} ms (forward and backward, (4, {args.seq}, "
              f"{args.d}) float32): the fallback takes {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
