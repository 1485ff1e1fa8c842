"""``torch.distributed.checkpoint`` planners over the blocks a program holds, nothing put together.

A tensor of the checkpoint is given as :class:`Pieces`: its whole shape and dtype and the blocks
of it this process holds (:func:`~dpcompile.checkpoint.rank_writes.target_blocks`: every shard in
one process, this rank's piece over a mesh). :class:`PiecesSavePlanner` writes each block as a
chunk of the tensor (as a DTensor's shards are written; replicas are written once, by torch's own
de-duplication), so the metadata is the one plain torch writes and reads. :class:`PiecesLoadPlanner`
reads into each block only the chunks that overlap it (torch's resharding), straight into the
program's tensors. Other values (hyper-parameters, the training state's JSON) are torch's byte items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dpcompile.checkpoint.rank_writes import Block


@dataclass
class Pieces:
    """A tensor of ``shape`` and ``dtype`` of which this process holds ``blocks()``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Callable[[], list[Block]]

    def at(self, offset: Any, made: list[Block]) -> torch.Tensor:
        for block in made:
            if tuple(block.box.starts) == tuple(offset):
                return block.view
        raise KeyError(f"no block at {tuple(offset)}")


class PiecesSavePlanner(DefaultSavePlanner):
    """Writes ``{fqn: Pieces or value}`` (already flat; ``mappings``: each fqn's place in the nested
    state dict plain torch would save, ``("model", key)``)."""

    def __init__(self, mappings: Mapping[str, tuple[Any, ...]]):
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False, enable_plan_caching=False)
        self.fqn_paths = dict(mappings)
        self.made: dict[str, list[Block]] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings, self.is_coordinator = state_dict, self.fqn_paths, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, Pieces):
                plain = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
                plain.set_up_planner({fqn: obj}, is_coordinator=self.is_coordinator)  # a value: the coordinator writes it
                items += plain.create_local_plan().items
                continue
            self.made[fqn] = obj.blocks()
            for block in self.made[fqn]:
                offsets, sizes = torch.Size(block.box.starts), torch.Size(block.box.sizes)
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties.create_from_tensor(block.view),
                        size=torch.Size(obj.shape),
                    ),
                ))  # fmt: skip
        self.plan = dataclasses.replace(SavePlan(items), planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.at(index.offset, self.made[index.fqn]).contiguous()
        return super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """Reads ``{fqn: Pieces or None}``: each block gets the chunks that overlap it; a byte item's
    value is left in ``values[fqn]``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.made: dict[str, list[Block]] = {}
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> Any:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

        items = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(md, BytesStorageMetadata):
                items.append(_create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0))
                continue
            self.made[fqn] = obj.blocks()
            chunks = [ChunkStorageMetadata(torch.Size(b.box.starts), torch.Size(b.box.sizes)) for b in self.made[fqn]]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)  # strings, numbers, tuples: nothing to unpickle

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        made = self.made[index.fqn]
        if index.index is not None and index.index < len(made):
            return made[index.index].view
        return self.state_dict[index.fqn].at(index.offset, made)


__all__ = ["Pieces", "PiecesLoadPlanner", "PiecesSavePlanner"]
