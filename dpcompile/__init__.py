"""dpcompile: compile a single-device PyTorch model into a readable multi-device program.

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
>>> print(pm.code)  # doctest: +SKIP
"""

from dpcompile.api import transform
from dpcompile.errors import DpCompileError, TraceError
from dpcompile.module import ParallelModule

__version__ = "0.1.0"

__all__ = [
    "DpCompileError",
    "ParallelModule",
    "TraceError",
    "transform",
    "__version__",
]
