"""1,000+ mutated checkpoint folders (tests/checkpoint_fuzz.py): every one a clean load or a
``CheckpointError`` naming a file, and on every error the program's parameters and buffers exactly
as before. ``benchmarks/fuzz_checkpoint.py`` runs more."""

from __future__ import annotations

import pytest

from tests.checkpoint_fuzz import program, run_cases


@pytest.mark.parametrize(
    "tensor_parallel, count", [(False, 1000), (True, 300)], ids=["data_parallel", "tensor_parallel"]
)
def test_every_mutated_checkpoint_loads_cleanly_or_is_a_checkpoint_error_that_changes_nothing(tensor_parallel, count):
    figures = run_cases(count, seed=0, pm=program(tensor_parallel))
    assert figures.bad == []
    assert figures.cases == count == figures.clean + figures.errors
    assert figures.unchanged_on_error == figures.errors
    assert figures.clean > 0 and figures.errors > count // 2  # both outcomes are exercised
    assert set(figures.kinds) == {"append", "edit_header", "edit_index", "edit_shards", "length_lies",
                                  "random_bytes", "truncate"}  # fmt: skip
