"""The executable programs ``transform`` returns: one module kind, :class:`~dpcompile.modules.base.ParallelModule`,
holding its program(s), an executor (:mod:`~dpcompile.modules.executors`; over a mesh
:class:`~dpcompile.modules.spmd.SpmdExecutor`) and, where parameters are stored as pieces, the sharded
state (:mod:`~dpcompile.modules.sharded_state`); a mesh's pipeline stage is still a class of its own,
:class:`~dpcompile.modules.mesh_pipeline.MeshPipelineModule`.
"""

from dpcompile.modules.base import ParallelModule

__all__ = ["ParallelModule"]
