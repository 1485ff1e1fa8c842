"""``PipelineTensorParallelModule``: pipeline stages whose layers are sharded over each stage's devices.

A :class:`~dpcompile.modules.pipeline.PipelineModule` (stages, micro-batches, ``pm.stages[i].code``)
that owns its shards as a :class:`~dpcompile.modules.tensor_parallel.TensorParallelModule` does:
the model is left as it was, ``pm.parameters()`` are the shards and the replicated rest (build the
optimizer over them), ``pm.state_dict()`` has the model's keys with full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpcompile.devices import Devices
from dpcompile.fx_utils import reserve_names
from dpcompile.modules.pipeline import PipelineModule
from dpcompile.modules.tensor_parallel import TensorParallelModule


class PipelineTensorParallelModule(PipelineModule, TensorParallelModule):
    """Stage ``i`` runs on ``pm.stage_groups[i]`` (``devices[i*T:(i+1)*T]``), its layers sharded
    over them as ``pm.plan`` says.

    >>> import torch, dpcompile
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> pm = dpcompile.transform(model, ["cpu"] * 4, pipeline=2, tensor_parallel=True, micro_batches=2)
    >>> [s.module_paths for s in pm.stages], pm.plan
    ([('0', '1'), ('2', '3')], {'0': 'column', '1': 'row', '2': 'column', '3': 'row'})
    """

    own_attributes = PipelineModule.own_attributes | frozenset({"stage_groups"})

    def set_stage_groups(self, groups: Sequence[Devices]) -> None:
        """Record the devices of each stage."""
        object.__setattr__(self, "stage_groups", [tuple(g.strings()) for g in groups])

    def param_bytes_per_slot(self) -> dict[int, int]:
        """Bytes of parameters each device (``devices[s*T + k]``) holds: stage ``s``'s shard ``k``
        and, on ``k == 0``, the stage's replicated rest."""
        out = dict.fromkeys(range(len(self.devices)), 0)
        slot_of: dict[int, int] = {}
        for node in self.graph.nodes:
            if node.op == "get_attr" and "dpcompile_slot" in node.meta:
                value = self.get_parameter(str(node.target)) if _is_parameter(self, str(node.target)) else None
                if value is not None:
                    slot_of.setdefault(id(value), node.meta["dpcompile_slot"])
        for p in self.parameters():
            slot = slot_of.get(id(p))
            if slot is not None:
                out[slot] += p.numel() * p.element_size()
        return out


def _is_parameter(module: PipelineModule, target: str) -> bool:
    try:
        module.get_parameter(target)
    except AttributeError:
        return False
    return True


reserve_names(PipelineTensorParallelModule.own_attributes)
