"""The executable programs ``transform`` returns: one module kind, :class:`~dpcompile.modules.base.ParallelModule`,
holding its program(s), an executor (:mod:`~dpcompile.modules.executors`) and, where parameters are
stored as pieces, the sharded state (:mod:`~dpcompile.modules.sharded_state`); over a DeviceMesh
:class:`~dpcompile.modules.spmd.SpmdModule` (one rank's program) and
:class:`~dpcompile.modules.mesh_pipeline.MeshPipelineModule` (one rank's pipeline stage).
"""

from dpcompile.modules.base import ParallelModule
from dpcompile.modules.spmd import SpmdModule

__all__ = ["ParallelModule", "SpmdModule"]
