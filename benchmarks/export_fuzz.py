"""Fuzz ``dpcompile.load`` with many random mutations of real program.json files (the same
programs and mutations as tests/tools/test_export_fuzz.py, more of them) and write the tally
to benchmarks/results/export_fuzz.json.

    PYTHONPATH=. python benchmarks/export_fuzz.py --count 5000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.tools.export_fuzz import fuzz
from tests.tools.test_export_fuzz import bases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        programs = bases(work)
        start = time.perf_counter()
        tally = fuzz(programs, work, work / "PWNED", count=args.count, seed=args.seed)
        seconds = time.perf_counter() - start
    result = {
        "command": f"PYTHONPATH=. python benchmarks/export_fuzz.py --count {args.count} --seed {args.seed}",
        "programs": [b.name for b in programs],
        "tried": tally.tried,
        "refused": tally.refused,
        "loaded": tally.loaded,
        "loaded_and_ran": tally.ran,
        "loaded_and_raised_at_call": tally.raised,
        "payloads_run": tally.payloads,
        "mutations_by_kind": tally.by_kind,
        "seconds": round(seconds, 1),
    }
    out = Path(__file__).parent / "results" / "export_fuzz.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(tally.line())


if __name__ == "__main__":
    main()
