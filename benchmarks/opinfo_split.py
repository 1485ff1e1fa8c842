"""The OpInfo proof, whole: every OpInfo sample split by its batch rule over 2 and 3 virtual
devices and checked against the op, in both IRs, and for every sample where a split on the
sample's dim 0 exists (the oracle: the op on chunks of the rows, joined, equals the op), whether
the rule split it; per op family in the JSON (``by_family``), with the ops kept whole and why.

    PYTHONPATH=. python -m benchmarks.opinfo_split --all            # fx spellings, every sample
    PYTHONPATH=. python -m benchmarks.opinfo_split --aten --max=2   # core ATen (export), 2 per op

Writes ``benchmarks/results/opinfo_split.json`` / ``opinfo_split_aten.json``. Exits 1 where a split
program differs from the op, or where an op keeps a splittable sample whole without its reason in
``dpcompile/analysis/batch_rules/reasons.py`` (``WHOLE_REASONS``), naming the op. ``--ops=a,b`` and
``--prefix=linalg.``, ``--ops-file=F`` run a slice (``--write``: to ``opinfo_split_slice[_aten].json``):

    PYTHONPATH=. python -m benchmarks.opinfo_split --ops=cumprod,quantile --prefix=masked.
"""

from __future__ import annotations

import sys

from tests.analysis.opinfo_split import exit_status, main

if __name__ == "__main__":
    argv = sys.argv[1:]
    raise SystemExit(exit_status(main(argv if "--all" in argv or "--max" in " ".join(argv) else [*argv, "--all"])))
