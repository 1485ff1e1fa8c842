"""``dpcompile.register_batch_rule``: teach data parallelism how a third-party function (one that
fx keeps as a call, ``torch.fx.wrap``), a Tensor method or a module type treats the batch.

>>> import torch, dpcompile
>>> def scale(x):  # imagine it is wrapped: @torch.fx.wrap
...     return x * 2
>>> dpcompile.register_batch_rule(scale, "elementwise", replace=True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpcompile.analysis.batch_rules.context import RuleContext
from dpcompile.analysis.batch_rules.registry import BATCH_RULES
from dpcompile.analysis.batch_rules.third_party import per_sample
from dpcompile.analysis.placement import Placement, Replicated, Split, Tuple, Whole
from dpcompile.errors import ArgumentError

UserRule = Callable[[list[int | None]], Any]


def register_batch_rule(target: Any, rule: str | UserRule, *, replace: bool = False) -> None:
    """Say how ``target`` treats the batch; every later ``transform`` uses it.

    ``target``: a function (as fx records it: the ``torch.fx.wrap``-ped function itself), a
    Tensor method name (``"my_op"``) or an ``nn.Module`` subclass kept as a leaf. ``rule``:

    - ``"elementwise"``: per sample; the output is split as its first tensor argument (other
      tensor arguments carry no batch or are split on the same dim);
    - ``"whole"``: it needs the whole batch; it runs once, on the gathered batch;
    - a callable ``rule(in_dims) -> out_dims``, as ``torch.vmap``'s ``in_dims``/``out_dims``:
      ``in_dims`` has, for each tensor input of the call in order, the dim it is split on, or
      None where it carries no batch; return the dim the output is split on, None where the
      output carries no batch, a tuple of those for a tuple output, or ``"whole"`` to run it
      whole. It is only asked about calls whose inputs are all split or unbatched.

    Registering a target twice is an error unless ``replace=True``.
    """
    if rule == "elementwise":
        compiled = per_sample
    elif rule == "whole":
        compiled = _whole
    elif callable(rule):
        compiled = _from_callable(rule)
    else:
        raise ArgumentError(f"rule={rule!r}: expected 'elementwise', 'whole' or a callable rule(in_dims) -> out_dims")
    BATCH_RULES.register(target, compiled, replace=replace)


def _whole(ctx: RuleContext) -> Placement | None:
    return Whole(reason=f"registered as 'whole' ({ctx.node.target!r})")


def _placement(out: Any) -> Placement | None:
    if out is None:
        return Replicated()
    if isinstance(out, bool) or out == "whole":
        return None
    if isinstance(out, int) and out >= 0:
        return Split(out)
    if isinstance(out, (tuple, list)):
        items = [_placement(o) for o in out]
        return None if any(i is None for i in items) else Tuple(tuple(items))
    raise ValueError(f"a batch rule returned {out!r}: expected a dim >= 0, None, 'whole' or a tuple of those")


def _from_callable(rule: UserRule) -> Callable[[RuleContext], Placement | None]:
    def compiled(ctx: RuleContext) -> Placement | None:
        dims: list[int | None] = []
        for node in ctx.node.all_input_nodes:
            p = ctx.p(node)
            if isinstance(p, Split):
                dims.append(p.dim)
            elif isinstance(p, Replicated):
                dims.append(None)
            else:
                return None  # a batch size, a packed sequence or a tuple: not a tensor split on a dim
        return _placement(rule(dims))

    compiled.__name__ = getattr(rule, "__name__", "user_rule")
    return compiled


__all__ = ["register_batch_rule"]
