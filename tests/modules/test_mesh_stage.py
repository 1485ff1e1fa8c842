"""What a pipeline over a mesh adds around PipelineStage, without a process group: runs of equal
micro-batches with ``tensor_split``'s sizes, stage programs with only contiguous tensors on the
wire, FSDP's shard shapes and the model's tied state keys."""

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
    same, ins, outs = on_wire(program, (h, 2, torch.device("cpu")), (h, 3), first=True, device=torch.device("cpu"))
    assert len(ins) == 3, "the first stage is fed the model's own inputs: nothing bound"


def test_sent_tensors_are_contiguous():
    """A stage output that is a view (Llama's rotary cos/sin are expanded) is sent contiguous:
    gloo's send refuses a non-contiguous tensor."""

    def stage(h):
        return h.t(), h[:1].expand(4, 3)

    program = fx.symbolic_trace(stage)
    h = torch.randn(2, 3)
    module, _, _ = on_wire(program, (h,), stage(h), first=True, device=torch.device("cpu"))
    sent = module(h)
    assert all(t.is_contiguous() for t in sent)
    torch.testing.assert_close(sent, stage(h))


def test_local_rows_shape_is_fsdps_chunk():
    """FSDP2 shards dim 0 as torch.chunk does; a rank past the last chunk holds no rows."""
    from dpcompile.modules.mesh_stage_dp import local_rows_shape

    assert local_rows_shape(torch.Size((5, 3)), 2, 0) == (3, 3)
    assert local_rows_shape(torch.Size((5, 3)), 2, 1) == (2, 3)
    assert local_rows_shape(torch.Size((2, 3)), 4, 3) == (0, 3)
    assert local_rows_shape(torch.Size(()), 2, 1) == ()


def test_state_ties_name_every_key_of_a_tied_tensor():
    """Each state_dict key lists the keys of the same tensor, its own first (tied weights)."""
    from dpcompile.recipes.pipeline_mesh import state_ties

    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 3), "head": torch.nn.Linear(3, 4, bias=False)})
    model["head"].weight = model["emb"].weight
    assert state_ties(model) == {
        "emb.weight": ("emb.weight", "head.weight"),
        "head.weight": ("head.weight", "emb.weight"),
    }
