"""Safetensors checkpoints for programs: ``load_checkpoint`` (each device reads only its slices)
and ``save_checkpoint`` (tensor by tensor; over a mesh each rank its own slices), in the layout
transformers writes, or ``torch.distributed.checkpoint`` folders (``format="dcp"``). See
``docs/big_models.md``."""

from dpcompile.checkpoint.agreement import load_checkpoint, save_checkpoint  # every rank of a mesh agrees
from dpcompile.checkpoint.buffers import BuffersNotComputedError, compute_buffers
from dpcompile.checkpoint.files import write_safetensors
from dpcompile.checkpoint.headers import CheckpointError, read_checkpoint

__all__ = [
    "BuffersNotComputedError", "CheckpointError", "compute_buffers", "load_checkpoint", "read_checkpoint",
    "save_checkpoint",
    "write_safetensors",
]  # fmt: skip
