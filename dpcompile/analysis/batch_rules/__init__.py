"""Per-op batch rules: how an op maps the placements of its inputs to the placement of its output.

A rule gets a :class:`RuleContext` and returns a :class:`~dpcompile.analysis.placement.Placement`,
or ``None`` when the op cannot run on chunks of the batch (the propagation of
:mod:`~dpcompile.analysis.batch_dims` then gathers its inputs and runs it once). Rules only see
nodes with at least one batch-carrying input; ``Partial`` and reduced ``Whole`` inputs are
shown to them as replicated (they are combined before use).

Rules are grouped by op family (the families of :mod:`dpcompile.analysis.ops`), one file each:

=================  ==============================================================
``pointwise``      element-wise ops, ``x.to(dtype)``
``shape``          views and shape ops, ``x.size()``, factories reading a batch size
``indexing``       ``x[...]`` and ``getattr``
``reductions``     sum/mean/amax..., softmax-like ops along one dim, losses
``matrix``         matmul, ``F.linear``, ``nn.Linear``
``modules``        convolutions, pooling, norms, embeddings, RNNs, attention
``selection``      gather/scatter/index_select/index_put, ``*_scatter``, fft and cdist along named dims
``aten``           what only ATen graphs need: ``slice``/``select``/``index``, attention, ATen losses
``third_party``    fx-wrapped functions of other libraries (stochastic depth, Swin), by name
``user``           :func:`dpcompile.register_batch_rule`: ``"elementwise"``, ``"whole"`` or a callable
``linalg``         ``torch.linalg.*`` (and ``torch.det``, ``torch.svd``...) on stacks of matrices
``named_dims``     cumulative ops, quantiles, median/mode/kthvalue, ``var_mean``, ``take_along_dim``
``masked``         ``torch.masked`` reductions and normalisations along named dims
``losses``         per-element losses beyond ``LOSS_FUNCTIONS`` (Gaussian/Poisson NLL, margins)
``products``       ``dot``/``inner``/``outer``/``mv``, ``F.bilinear``, ``cross``, ``linalg.vecdot``
``reorder``        ``fliplr``, ``rot90``, ``tile``, ``movedim``, ``atleast_*d``, the ``*_copy`` views
``per_sample_ops`` antialiased upsampling, 3-D grid sampling, ``F.softmin``
``random_sizes``   ``torch.normal(mean, std, size)`` with a size holding the batch size
``reasons``        why an op runs whole where a split of its rows exists (one table)
``structures``     the OrderedDict / namedtuple / dataclass forward returns, built from gathered values
=================  ==============================================================

``over_dims`` holds the factories the newer files share (an op along, or over, the dims its
arguments name; an op on the last dims, batched over the ones before).

Each file registers its rules in :data:`BATCH_RULES` (:class:`BatchRuleRegistry`), one table
by target; :func:`rule_for` looks a node's rule up there. :mod:`~dpcompile.analysis.batch_rules.table`
gives every ATen op (the whole core opset) its rule or an explicit ``whole``, registered for the
op and its fx spellings alike.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from dpcompile.analysis.batch_rules import (  # noqa: F401 - they register
    attention,
    batch_values,
    dp_copies,
    indexing,
    linalg,
    losses,
    masked,
    matrix,
    model_constructs,
    modules,
    named_dims,
    per_sample_ops,
    pointwise,
    products,
    random_sizes,
    reasons,
    reductions,
    reorder,
    shape,
    tensor_parallel,
    third_party,
)
from dpcompile.analysis.batch_rules import table as table  # noqa: F401 - after the families: the ATen ops and their spellings
from dpcompile.analysis.batch_rules.aten import aten_rule
from dpcompile.analysis.batch_rules.context import Rule, RuleContext, node_shape
from dpcompile.analysis.batch_rules.modules import batch_first
from dpcompile.analysis.batch_rules.reductions import bind_loss, loss_kwargs_of_module
from dpcompile.analysis.batch_rules.registry import BATCH_RULES, BatchRuleRegistry
from dpcompile.analysis.batch_rules.structures import builds_returned_structure, returned_structure
from dpcompile.analysis.batch_rules.user import register_batch_rule
from dpcompile.analysis.ops import BATCH_NORMS, LOSS_FUNCTIONS, LOSS_MODULES
from dpcompile.runtime import flatten_parameters as runtime_flatten_parameters

reasons.register()  # last: a whole rule with its written reason for each op no family has a rule for


def rule_for(node: fx.Node, module: nn.Module | None) -> Rule | None:
    """The batch rule for ``node`` (``module``: what a ``call_module`` node calls), or ``None``."""
    if node.op == "call_function" and node.target is runtime_flatten_parameters:
        return None  # an RNN weight flattening call, not an op on the batch
    rule = BATCH_RULES.lookup(node, module)
    if rule is None and node.op == "call_function":  # ATen ops of graphs the export frontend captured
        rule = aten_rule(node)
    if rule is None and builds_returned_structure(node):
        rule = returned_structure
    return rule


__all__ = [
    "register_batch_rule",
    "BATCH_RULES",
    "BatchRuleRegistry",
    "Rule",
    "RuleContext",
    "rule_for",
    "builds_returned_structure",
    "node_shape",
    "batch_first",
    "bind_loss",
    "loss_kwargs_of_module",
    "LOSS_MODULES",
    "LOSS_FUNCTIONS",
    "BATCH_NORMS",
]
