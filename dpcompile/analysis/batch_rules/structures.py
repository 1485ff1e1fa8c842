"""The structure forward returns, built by a call: an ``OrderedDict`` (torchvision's segmentation
models), a namedtuple (Inception-v3's ``InceptionOutputs``, GoogLeNet's), a dataclass
(transformers' ``ModelOutput``) or a ``torch.return_types`` tuple.

Such a call computes nothing on the batch: it holds the values forward returns, so it is built
once from the gathered outputs, as eager builds it. It runs whole, but it is not work that runs
unsplit, so ``explain(...).whole`` does not list it (it said "no batch rule for
collections.OrderedDict")::

    def forward(self, x):                       # the program, data parallel on 2 devices
        result = OrderedDict()                  #   out = gather([out_dev0, out_dev1], 0, 'cpu')
        result["out"] = self.head(x)            #   ordered_dict = OrderedDict({'out': out})
        return result                           #   return ordered_dict
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.placement import Placement, Whole


def _structure_type(target: object) -> bool:
    if not isinstance(target, type):
        return False
    if issubclass(target, dict):
        return True
    if issubclass(target, tuple):  # a namedtuple, or torch.return_types' structseq
        return hasattr(target, "_fields") or hasattr(target, "n_fields")
    return dataclasses.is_dataclass(target)


def builds_returned_structure(node: fx.Node) -> bool:
    """``node`` builds a structure (a dict subclass, namedtuple, dataclass) that only forward's
    output reads."""
    return (
        node.op == "call_function"
        and _structure_type(node.target)
        and bool(node.users)
        and all(user.op == "output" for user in node.users)
    )


def returned_structure(ctx: RuleContext) -> Placement:
    """Built once, from the gathered values it holds."""
    return Whole(batch=True, reason=f"builds the returned {getattr(ctx.node.target, '__name__', 'structure')}")
