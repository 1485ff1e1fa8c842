"""Fuzz ``dpcompile.load_checkpoint`` with mutated checkpoint folders (the generator of
tests/checkpoint_fuzz.py: broken headers, bad index files, inconsistent shard sets), into a data
parallel and a tensor parallel program, and write the figures to
benchmarks/results/fuzz_checkpoint.json.

    PYTHONPATH=. python benchmarks/fuzz_checkpoint.py --count 10000 --seed 1

Every case must be a clean load or a ``CheckpointError`` naming a file, and on every error the
program's parameters and buffers must be unchanged (compared with a snapshot); the script exits
1 listing the cases that were neither.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.checkpoint_fuzz import program, run_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10000, help="cases per program")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fuzz_checkpoint.json"))
    args = parser.parse_args()
    result: dict[str, object] = {
        "command": f"PYTHONPATH=. python benchmarks/fuzz_checkpoint.py --count {args.count} --seed {args.seed}",
    }
    bad: list[str] = []
    for name, tensor_parallel in (("data_parallel", False), ("tensor_parallel", True)):
        figures = run_cases(args.count, seed=args.seed, pm=program(tensor_parallel))
        result[name] = figures.as_dict()
        bad += [f"{name}: {line}" for line in figures.bad]
        print(name, json.dumps(figures.as_dict()))
    result["other_outcomes"] = bad[:50]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if bad:
        print("\n".join(bad[:20]))
        sys.exit(1)


if __name__ == "__main__":
    main()
