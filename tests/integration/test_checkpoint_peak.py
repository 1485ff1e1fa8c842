"""A safetensors save or load adds at most one piece (the largest tensor one device holds) to the
program's memory: every buffer they allocate, counted by torch's CPU allocator (the profiler's
allocation events, a file mapping included), stays within the piece it copies, one at a time."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import dpcompile
from dpcompile.checkpoint import runs
from dpcompile.checkpoint.headers import read_header
from dpcompile.checkpoint.rank_writes import write_blocks
from dpcompile.checkpoint.slices import read_blocks
from tests.integration.test_rank_writes import CASES, _pieces


def _allocated(fn) -> tuple[int, int]:
    """``(peak, end)``: the most bytes the CPU allocator held at once while ``fn`` ran, and at its
    end, counting only what was allocated during it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted(
        (n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation),
        key=lambda n: n.start_time_ns,
    )
    totals = [n.extra_fields.total_allocated for n in events if n.extra_fields.device.type == "cpu"]
    return max([0, *totals]), (totals[-1] if totals else 0)


@pytest.mark.parametrize(("shape", "spec", "rows_dim", "replicas"), CASES)
def test_blocks_are_written_and_read_through_one_bounded_buffer(shape, spec, rows_dim, replicas, tmp_path, monkeypatch):
    """Each rank's blocks written in place and read back (straight into the piece, or staged where
    its dtype or layout differs from the file's): the whole tensor's bytes both ways, and nothing
    allocated past the largest block (or the staging bound, where smaller, but one row)."""
    whole = torch.randn(shape, dtype=torch.float64)
    ranks = _pieces(whole, spec, rows_dim, replicas)
    blocks = [b for blocks in ranks for b in blocks]
    largest = max(b.view.numel() * 8 for b in blocks)
    file = tmp_path / "t.safetensors"
    from safetensors.torch import save_file

    save_file({"t": torch.zeros(shape, dtype=torch.float64)}, str(file))
    entry = read_header(file)["t"]
    at = file.stat().st_size - whole.numel() * 8
    for bound in (runs.STAGING_BYTES, 8, 40):
        monkeypatch.setattr(runs, "STAGING_BYTES", bound)
        row = max(b.view[0].numel() * 8 if b.view.dim() else 8 for b in blocks)
        distinct = list({b.box: b for b in blocks}.values())
        written: list[int] = []
        fd = os.open(file, os.O_WRONLY)
        try:
            peak, _ = _allocated(lambda fd=fd, d=distinct, w=written: w.append(write_blocks(fd, at, shape, torch.float64, d)))
        finally:
            os.close(fd)
        assert written == [whole.numel() * 8] and peak <= min(largest, max(bound, row)), (bound, written, peak)
        for dtype in (torch.float64, torch.float32):  # straight into the piece; staged and cast
            for rank in ranks:
                views = [torch.empty_strided(b.view.shape, b.view.stride(), dtype=dtype).zero_() for b in rank]
                into = [type(b)(b.box, v) for b, v in zip(rank, views)]
                peak, _ = _allocated(lambda into=into: read_blocks(entry, into))
                assert peak <= min(largest, max(bound, row)), (bound, dtype, peak)
                for b, v in zip(rank, views):
                    assert torch.equal(v, b.view.to(dtype)), (bound, dtype, b.box)


class _Tiny(nn.Module):
    """An embedding, a column- and a row-parallel Linear, an LM head: each tensor-parallel kind of shard."""

    def __init__(self, vocab: int = 256, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.down(torch.relu(self.up(x))))


def _trained():
    torch.manual_seed(0)
    pm = dpcompile.transform(_Tiny(), ["cpu"] * 4, tensor_parallel=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(torch.randint(0, 256, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    return pm, opt


def test_a_save_and_a_load_stage_at_most_one_piece(tmp_path):
    """A training checkpoint of a tensor-parallel program (its row-parallel weight is 4 pieces
    whole): the save allocates at most one piece at once; the load allocates the optimizer's state
    it keeps and at most one piece beside it (no file mapped); what it loads is what was saved."""
    pm, opt = _trained()
    piece = max(p.numel() * p.element_size() for p in pm.parameters())
    assert max(t.numel() * t.element_size() for t in pm.state_dict().values()) >= 4 * piece  # gathered: past the bound
    peak, _ = _allocated(lambda: dpcompile.save_checkpoint(pm, tmp_path / "ckpt", optimizer=opt, progress=False))
    assert 0 < peak <= piece, (peak, piece)

    torch.manual_seed(1)
    fresh = dpcompile.transform(_Tiny(), ["cpu"] * 4, tensor_parallel=True)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    peak, end = _allocated(lambda: dpcompile.load_checkpoint(fresh, tmp_path / "ckpt", optimizer=fresh_opt, progress=False))
    state = sum(v.numel() * v.element_size() for s in fresh_opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert state <= end and peak - end <= piece, (peak, end, state, piece)
    for (name, p), q in zip(pm.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh_opt.state[q][key]), (name, key)
