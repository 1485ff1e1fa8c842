"""The executable programs ``transform`` returns: one module kind, :class:`~dpcompile.modules.base.ParallelModule`,
holding its program(s), an executor (:mod:`~dpcompile.modules.executors`; over a mesh
:class:`~dpcompile.modules.spmd.SpmdExecutor`, a stage of a pipeline over a mesh
:class:`~dpcompile.modules.mesh_pipeline.MeshPipelineExecutor`) and, where parameters are stored as
pieces, the sharded state (:mod:`~dpcompile.modules.sharded_state`).
"""

from dpcompile.modules.base import ParallelModule

__all__ = ["ParallelModule"]
