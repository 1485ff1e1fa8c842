"""See what a :class:`~dpcompile.ParallelModule` will run: ``explain``, ``draw`` and ``diff``.

``explain(pm, *args)`` propagates fake tensors through the generated program (no real compute,
no real memory; BatchNorm running statistics are never touched) and returns a
:class:`Report`: per node its device, output shape and dtype, the pass that made it and the
user's source line; per collective the elements each device sends under ring algorithms,
forward and backward; per device the parameter bytes, an activation-bytes estimate, a FLOPs
estimate and the imbalance between devices.

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(8, 4), ["cpu", "cpu"])
>>> report = dpcompile.explain(pm, torch.randn(16, 8))
>>> report.param_bytes
{'cpu#0': 144, 'cpu#1': 144}
>>> print(report)  # doctest: +SKIP

Device keys are ``Devices.labels()``: the device strings (``"cuda:0"``) when every device is
distinct, ``"<device>#<slot>"`` (``"cpu#0"``, ``"cpu#1"``) for virtual devices.

The package, one concern per file:

- ``report``: :class:`Report` (with :class:`NodeInfo`, :class:`CollectiveInfo`), ``to_dict``
  and the table ``str(report)`` prints;
- ``explanation``: :func:`explain` and :func:`param_bytes`;
- ``measure``: :func:`measure`, one real step's peak bytes per device and its time, beside the prediction;
- ``recorder``: the interpreter that runs a program on fake tensors and records what it sees;
- ``nodes``: what the tools read off a node (``slot_of``, ``user_source``) and a module's devices;
- ``pictures``: :func:`draw` and its graphviz source :func:`to_dot`;
- ``code_diff``: :func:`diff`.

How many elements a collective moves is the rule of :mod:`dpcompile.analysis.cost`.
"""

from dpcompile.inspect.code_diff import diff
from dpcompile.inspect.explanation import ALL_DEVICES, explain, param_bytes
from dpcompile.inspect.measure import Measurement, measure
from dpcompile.inspect.nodes import slot_of, user_source
from dpcompile.inspect.pictures import draw, to_dot
from dpcompile.inspect.recorder import Recorder
from dpcompile.inspect.report import WIDTH, CollectiveInfo, NodeInfo, Report

__all__ = [
    "ALL_DEVICES",
    "WIDTH",
    "CollectiveInfo",
    "Measurement",
    "NodeInfo",
    "Recorder",
    "Report",
    "diff",
    "draw",
    "explain",
    "measure",
    "param_bytes",
    "slot_of",
    "to_dot",
    "user_source",
]
