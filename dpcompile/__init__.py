"""dpcompile: compile a single-device PyTorch model into a readable multi-device program.

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
>>> print(pm.code)  # doctest: +SKIP
"""

from dpcompile.analysis.batch_rules.user import register_batch_rule
from dpcompile.api import transform
from dpcompile.capture.inputs import InputMismatch
from dpcompile.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dpcompile.errors import ArgumentError, DpCompileError, ExampleError, PassError, StateDictError, TraceError
from dpcompile.export import export, load
from dpcompile.export.common import ExportError
from dpcompile.inspect import Measurement, Report, diff, draw, explain, measure
from dpcompile.mesh import local_batch
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.exported_check import ModelChanged
from dpcompile.modules.torch_save import install_atomic_torch_save
from dpcompile.runtime.distributed import CollectiveError
from dpcompile.verify import VerifyResult, verify
from dpcompile.version import __version__

install_atomic_torch_save()  # a refused torch.save(pm, path) leaves path as it was

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "CollectiveError",
    "DpCompileError",
    "ExampleError",
    "ExportError",
    "InputMismatch",
    "Measurement",
    "ModelChanged",
    "ParallelModule",
    "PassError",
    "Report",
    "StateDictError",
    "TraceError",
    "VerifyResult",
    "diff",
    "draw",
    "explain",
    "export",
    "load",
    "load_checkpoint",
    "local_batch",
    "measure",
    "register_batch_rule",
    "save_checkpoint",
    "transform",
    "verify",
    "__version__",
]
