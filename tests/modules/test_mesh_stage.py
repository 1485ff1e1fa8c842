"""What a pipeline over a mesh adds around PipelineStage, without a process group: runs of equal
micro-batches with ``tensor_split``'s sizes, and stage programs with only tensors on the wire."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.modules.mesh_stage import TensorsOnWire, micro_batch_runs, on_wire


def test_micro_batch_runs_have_tensor_splits_sizes():
    assert micro_batch_runs(8, 4) == [(4, 2)]
    assert micro_batch_runs(7, 4) == [(3, 2), (1, 1)]
    assert micro_batch_runs(10, 4) == [(2, 3), (2, 2)]
    assert micro_batch_runs(3, 4) == [(3, 1)]
    for batch in range(1, 20):
        for m in (1, 2, 3, 4, 5):
            sizes = [rows for count, rows in micro_batch_runs(batch, m) for _ in range(count)]
            assert sizes == [len(c) for c in torch.tensor_split(torch.arange(batch), min(batch, m))]


def test_ints_and_devices_are_bound_not_sent():
    """A later stage's ``(h, n, device)`` inputs: only ``h`` is received; ``n`` and the device are
    bound. Outputs that are not tensors are not sent."""

    def stage(h, n, device):
        return h.reshape(n, -1).to(device) * 2, n + 1

    program = fx.symbolic_trace(stage)
    h = torch.randn(2, 3)
    module, ins, outs = on_wire(program, (h, 2, torch.device("meta")), (h, 3), first=False, device=torch.device("cpu"))
    assert isinstance(module, TensorsOnWire) and len(ins) == 1 and len(outs) == 1
    (out,) = module(h)
    torch.testing.assert_close(out, h * 2)  # the device bound is this rank's: cpu
    same, _, _ = on_wire(program, (h,), (h,), first=False, device=torch.device("cpu"))
    assert same is program  # only tensors: the program itself
