"""What checking every DCP item before the first write costs (``dpcompile.checkpoint.dcp_items``): the time
of ``load_checkpoint`` of a ``format="dcp"`` folder (12 Linear(1024, 1024): 48 MB of float32 weights, data
parallel on 2 virtual devices) with the check and with it skipped, alternated in one process; the ratio of
the medians.

    PYTHONPATH=. python benchmarks/bench_dcp_item_check.py --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

import dpcompile
from dpcompile.checkpoint import dcp_items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # torch.distributed.checkpoint: "assuming the intent is ... a single process"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    pm = dpcompile.transform(model, ["cpu"] * 2, example_inputs=(torch.randn(2, 1024),))
    root = tempfile.mkdtemp()
    dpcompile.save_checkpoint(pm, f"{root}/ckpt", format="dcp")
    checked, times = dcp_items.check_items, {"checked": [], "skipped": []}
    try:
        for _ in range(args.repeats):
            for mode in times:
                dcp_items.check_items = checked if mode == "checked" else (lambda *a, **k: None)
                start = time.perf_counter()
                dpcompile.load_checkpoint(pm, f"{root}/ckpt")
                times[mode].append(time.perf_counter() - start)
    finally:
        dcp_items.check_items = checked
        shutil.rmtree(root, ignore_errors=True)
    c, s = statistics.median(times["checked"]), statistics.median(times["skipped"])
    print(f"median load: checked {c:.3f} s, check skipped {s:.3f} s, ratio {c / s:.2f} ({args.repeats} repeats each)")


if __name__ == "__main__":
    main()
