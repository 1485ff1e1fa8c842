"""Each rank's slices written in place (one process, the ranks played in turn): the boxes a piece
holds (row, column, fused-qkv shards, FSDP's rows of a shard) written by the ranks ``assign_writers``
picks give the whole tensor's bytes; pieces that do not tile a tensor are refused before a write."""

from __future__ import annotations

import os

import pytest
import torch

from dpcompile.checkpoint import runs
from dpcompile.checkpoint.files import CheckpointError
from dpcompile.checkpoint.rank_writes import Box, assign_writers, piece_blocks, write_blocks
from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of

CASES = [  # (shape, shard spec or None, FSDP rows dim or None, replicas of each piece)
    ((7, 4), ShardSpec(0, (4, 3)), None, 1),
    ((5, 6), ShardSpec(1, (2, 4)), None, 2),
    ((18, 4), ShardSpec(0, (12, 6), sections=3), None, 1),
    ((2, 3, 9), ShardSpec(2, (6, 3), sections=3), None, 2),
    ((12, 5), ShardSpec(0, (6, 6), sections=3), 0, 1),  # FSDP rows of a fused shard: across its sections
    ((6, 8), ShardSpec(1, (4, 4)), 0, 1),  # FSDP rows of a column-split (row-parallel) shard
    ((8,), None, None, 3),  # replicated
    ((), None, None, 2),  # 0-dim (a step count)
]


def _pieces(whole, spec, rows_dim, replicas):
    """``[(blocks of a rank)]``: each shard (each FSDP half of it) held by ``replicas`` ranks."""
    shards = [whole] if spec is None else [shard_of(whole, spec, k).clone() for k in range(len(spec.sizes))]
    out = []
    for k, shard in enumerate(shards):
        if rows_dim is None:
            parts = [(shard, None)]
        else:
            n = shard.shape[rows_dim]
            first = -(-n // 2)
            parts = [(shard.narrow(rows_dim, 0, first), (rows_dim, 0, first)),
                     (shard.narrow(rows_dim, first, n - first), (rows_dim, first, n - first))]  # fmt: skip
        for local, rows in parts:
            out += [piece_blocks(whole.shape, spec, k, local.clone(), rows) for _ in range(replicas)]
    return out


@pytest.mark.parametrize(("shape", "spec", "rows_dim", "replicas"), CASES)
def test_the_ranks_slices_written_in_place_are_the_whole_tensor(shape, spec, rows_dim, replicas, tmp_path, monkeypatch):
    whole = torch.randn(shape, dtype=torch.float64)
    ranks = _pieces(whole, spec, rows_dim, replicas)
    writers = assign_writers([{"t": [b.box for b in blocks]} for blocks in ranks], {"t": shape})
    assert sum(len(w.get("t", [])) for w in writers) == len({b.box for blocks in ranks for b in blocks})
    for run_bytes in (runs.STAGING_BYTES, 8, 40):  # a box at a time, a row at a time, a few rows
        monkeypatch.setattr(runs, "STAGING_BYTES", run_bytes)
        file = tmp_path / f"t{run_bytes}.bin"
        at = 24  # the tensor's data after some header bytes
        file.write_bytes(b"\xff" * (at + whole.numel() * 8))
        fd = os.open(file, os.O_WRONLY)
        try:
            for blocks, mine in zip(ranks, writers):
                boxes = set(mine.get("t", []))
                write_blocks(fd, at, shape, torch.float64, [b for b in blocks if b.box in boxes])
        finally:
            os.close(fd)
        data = bytearray(file.read_bytes()[at:])
        assert torch.equal(torch.frombuffer(data, dtype=torch.float64).reshape(shape), whole), run_bytes


def test_pieces_that_do_not_tile_are_refused_before_a_write():
    with pytest.raises(CheckpointError, match=r"'w' \[4, 2\].*hold 6 of its 8 elements"):
        assign_writers([{"w": [Box((0, 0), (3, 2))]}, {"w": []}], {"w": (4, 2)})
    with pytest.raises(CheckpointError, match="overlap"):
        assign_writers([{"w": [Box((0, 0), (3, 2))]}, {"w": [Box((2, 0), (2, 2))]}], {"w": (4, 2)})


def test_replicated_tensors_are_written_by_the_ranks_in_turn():
    whole = [{k: [Box((0,), (4,))] for k in "abcd"} for _ in range(4)]
    writers = assign_writers(whole, dict.fromkeys("abcd", (4,)))
    assert [sorted(w) for w in writers] == [["a"], ["b"], ["c"], ["d"]]
