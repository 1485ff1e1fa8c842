"""``PipelineTensorParallelModule``: pipeline stages whose layers are sharded over each stage's devices.

A :class:`~dpcompile.modules.pipeline.PipelineModule` (stages, micro-batches, ``pm.stages[i].code``)
that owns its shards as a :class:`~dpcompile.modules.tensor_parallel.TensorParallelModule` does:
the model is left as it was, ``pm.parameters()`` are the shards and the replicated rest (build the
optimizer over them), ``pm.state_dict()`` has the model's keys with full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

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
    pickles_private_source = True  # a copy builds the program of a smaller batch (fewer micro-batches)

    def set_stage_groups(self, groups: Sequence[Devices]) -> None:
        """Record the devices of each stage, and the device slot (``s * T + k``) of every parameter:
        stage ``s``'s shard ``k``, or its replicated rest on ``k == 0`` (``explain``'s bytes per device)."""
        object.__setattr__(self, "stage_groups", [tuple(g.strings()) for g in groups])
        slot_of: dict[int, int] = {}
        for node in self.graph.nodes:
            slot = node.meta.get("dpcompile_slot")
            if slot is None or node.op not in ("get_attr", "call_module"):
                continue
            parent, _, name = str(node.target).rpartition(".")
            value = (
                self.get_submodule(str(node.target))
                if node.op == "call_module"
                else getattr(self.get_submodule(parent), name)
            )
            tensors = value.parameters() if isinstance(value, nn.Module) else [value]
            for t in tensors:
                slot_of.setdefault(id(t), slot)
        self.shard_param_slots = {name: slot_of.get(id(p), 0) for name, p in self.named_parameters()}



    # ------------------------------------------------------------------ pickling
    def _extra_state_for_pickle(self) -> dict[str, Any]:
        """The stages' device groups and each parameter's slot beside the pipeline and the shards."""
        groups = {name: self.__dict__[name] for name in ("stage_groups", "shard_param_slots")}
        return {**super()._extra_state_for_pickle(), "stage_groups": groups}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        super()._restore_extra_state({k: v for k, v in extra.items() if k != "stage_groups"})
        for name, value in extra["stage_groups"].items():
            object.__setattr__(self, name, value)


reserve_names(PipelineTensorParallelModule.own_attributes)
