"""Check a :class:`~dpcompile.ParallelModule` against the eager model it came from.

``verify(pm, model, *args)`` runs both, forward and backward, and compares outputs, parameter
gradients, input gradients and buffers (BatchNorm running statistics) with dtype-aware
tolerances. It leaves no trace: gradients, buffers, dropout modes and the RNG state are
restored afterwards. ``fake_devices=8`` also checks the layout of an 8-GPU program on a
machine without them, with fake CUDA tensors (``FakeTensorMode``): an op that mixes devices
raises, and every per-device value must sit on its own device.

>>> import torch, dpcompile
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
>>> pm = dpcompile.transform(model, ["cpu", "cpu"])
>>> result = dpcompile.verify(pm, model, torch.randn(6, 8))
>>> bool(result)
True
"""

from dpcompile.verify.check import verify
from dpcompile.verify.layout import check_layout
from dpcompile.verify.result import TOLERANCES, Mismatch, VerifyResult, compare_tensors, default_tolerance

__all__ = ["TOLERANCES", "Mismatch", "VerifyResult", "check_layout", "compare_tensors", "default_tolerance", "verify"]
