"""Causal load balancing of context parallel's attention (``context_parallel={"load_balance": True}``):
each device's attention work before (contiguous shards) and after (zig-zag chunks), as ratios measured
in one run.

    PYTHONPATH=. python benchmarks/bench_context_parallel_balance.py [--seq 4096] [--mesh-seq 4096] [--repeats 3] [--json]

1. counted: each device's causal (query row, key) pairs on 4 devices at ``--seq``, max/min;
2. timed, one process: each device's attention call alone (forward and backward; no exchange, as
   one rank computes it), ``attention_regathered`` against ``balanced_attention``, max/min of the
   medians over ``--repeats`` rounds, all eight calls interleaved in each (``(batch 1, 4 heads, seq,
   16)``, float32, one thread);
3. timed, 4 gloo ranks (``("cp",)`` mesh, one thread each): one training step of a 4-layer causal
   decoder (``d=64``) at ``--mesh-seq``, ``load_balance=False`` against ``True`` in the same ranks,
   alternated, the median of ``--repeats`` steps (the slowest rank's time: every rank waits for it).
   On a machine with fewer free cores than ranks the ranks share cores and the step's time follows the
   total work, not the slowest rank's: the ratio then understates what balancing gives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.bench_context_parallel import Decoder
from benchmarks.common import RESULTS
from dpcompile.runtime import attention_regathered, balanced_attention
from dpcompile.runtime.sequence_balance import balanced_sizes, causal_rows_keys

DEVICES = 4


def counted(seq: int) -> dict:
    before, after = causal_rows_keys(seq, DEVICES, False), causal_rows_keys(seq, DEVICES, True)
    return {"rows_keys_before": before, "rows_keys_after": after, "max_over_min_before": max(before) / min(before),
            "max_over_min_after": max(after) / min(after)}  # fmt: skip


def _median_times(fns: list, repeats: int) -> list[float]:
    """Each function's median time over ``repeats`` rounds, the functions interleaved in each round
    (so a change of the machine's load falls on all alike), after one warm-up round."""
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if round_:
                times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def timed_calls(seq: int, repeats: int) -> dict:
    """Each device's attention call (forward + backward), contiguous against zig-zag."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    sizes = balanced_sizes(seq, DEVICES)
    q, k, v = (torch.randn(1, 4, seq, 16, generator=g).split(sizes, 2) for _ in range(3))
    q, k, v = ([t.clone().requires_grad_() for t in ts] for ts in (q, k, v))
    starts = [sum(sizes[:r]) for r in range(DEVICES)]

    def step(fn):
        out = fn()
        out.sum().backward()

    fns = [lambda r=r: step(lambda: attention_regathered(q[r], k, v, 2, "cpu", torch.arange(starts[r], starts[r] + sizes[r])))
           for r in range(DEVICES)]  # fmt: skip
    fns += [lambda r=r: step(lambda: balanced_attention(q, k, v, 2, r)) for r in range(DEVICES)]
    medians = _median_times(fns, repeats)
    before, after = medians[:DEVICES], medians[DEVICES:]
    return {"seconds_before": before, "seconds_after": after, "max_over_min_before": max(before) / min(before),
            "max_over_min_after": max(after) / min(after), "slowest_after_over_before": max(after) / max(before)}  # fmt: skip


def _rank(rank: int, port: int, seq: int, repeats: int, results) -> None:
    try:
        _timed_steps(rank, port, seq, repeats, results)
    except Exception:  # noqa: BLE001 - the parent waits for a report: send the failure instead
        import traceback

        results.put({"error": f"rank {rank}: {traceback.format_exc()}"})


def _timed_steps(rank: int, port: int, seq: int, repeats: int, results) -> None:
    import copy
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dpcompile
    from dpcompile.mesh import local_batch

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DEVICES,
                            timeout=timedelta(seconds=600))  # fmt: skip
    mesh = init_device_mesh("cpu", (DEVICES,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = Decoder()
    x = local_batch(torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(0)), mesh)
    programs = {
        balance: dpcompile.transform(copy.deepcopy(model), mesh, example_inputs=(x,),
                                     context_parallel={"load_balance": balance})  # fmt: skip
        for balance in (False, True)
    }
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats + 1):  # the first of each: warm-up, dropped
        for balance, pm in programs.items():
            dist.barrier()
            start = time.perf_counter()
            pm(x).backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            times[balance].append(float(elapsed))
    if rank == 0:
        results.put({b: t[1:] for b, t in times.items()})
    dist.destroy_process_group()


def timed_mesh(seq: int, repeats: int) -> dict:
    from tests.gloo_groups import free_port, rank_context

    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, seq, repeats, results)) for r in range(DEVICES)]
    for p in procs:
        p.start()
    times = results.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if "error" in times:
        raise RuntimeError(times["error"])
    before, after = statistics.median(times[False]), statistics.median(times[True])
    return {"step_seconds_before": times[False], "step_seconds_after": times[True], "median_before": before,
            "median_after": after, "after_over_before": after / before}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mesh-seq", type=int, default=4096, help="0: skip the gloo mesh")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="write benchmarks/results/context_parallel_balance.json")
    args = parser.parse_args()
    row = {"seq": args.seq, "devices": DEVICES, "counted": counted(args.seq)}
    c = row["counted"]
    print(f"causal (row, key) pairs per device at {args.seq} tokens on {DEVICES}: contiguous {c['rows_keys_before']} "
          f"(max/min {c['max_over_min_before']:.2f}), zig-zag {c['rows_keys_after']} (max/min {c['max_over_min_after']:.2f})")
    row["one_process"] = t = timed_calls(args.seq, args.repeats)
    print(f"each device's attention call, forward + backward (s): contiguous {[round(s, 3) for s in t['seconds_before']]} "
          f"(max/min {t['max_over_min_before']:.2f}), zig-zag {[round(s, 3) for s in t['seconds_after']]} "
          f"(max/min {t['max_over_min_after']:.2f}); slowest device after/before {t['slowest_after_over_before']:.2f}")
    if args.mesh_seq:
        row["mesh"] = m = timed_mesh(args.mesh_seq, args.repeats)
        m["seq"] = args.mesh_seq
        print(f"one training step over 4 gloo ranks at {args.mesh_seq} tokens (s, slowest rank): load_balance=False "
              f"{[round(s, 3) for s in m['step_seconds_before']]}, True {[round(s, 3) for s in m['step_seconds_after']]}: "
              f"median after/before {m['after_over_before']:.2f}")
    if args.json:
        (RESULTS / "context_parallel_balance.json").write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
