"""The executable programs ``transform`` returns: one base, one kind per parallelism.

* :class:`~dpcompile.modules.base.ParallelModule` (data parallel, and the base of all);
* :class:`~dpcompile.modules.tensor_parallel.TensorParallelModule`;
* :class:`~dpcompile.modules.spmd.SpmdModule` (one rank's program over a DeviceMesh).
"""

from dpcompile.modules.base import ParallelModule
from dpcompile.modules.spmd import SpmdModule
from dpcompile.modules.tensor_parallel import TensorParallelModule

__all__ = ["ParallelModule", "SpmdModule", "TensorParallelModule"]
