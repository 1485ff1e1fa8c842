"""The table batch rules are looked up in, by target: a function, a Tensor method, a module type or an ATen op.

>>> from dpcompile.analysis.batch_rules import BATCH_RULES
>>> import torch
>>> BATCH_RULES.function_rule(torch.relu).__name__
'pointwise'

Registering is one call whatever the target's kind (:meth:`BatchRuleRegistry.register`):
``BATCH_RULES.register(torch.special.erfcx, pointwise)``, ``.register("erfcx", pointwise)`` (a
method), ``.register(MyNorm, per_sample_dim0)`` (a module type and its subclasses) or
``.register(torch.ops.aten.erfcx.default, pointwise)`` (an ATen overload; ``torch.ops.aten.erfcx``,
the packet, covers all its overloads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from dpcompile.analysis.batch_rules.context import Rule
from dpcompile.analysis.ops import OpFamily
from dpcompile.errors import ArgumentError


@dataclass
class BatchRuleRegistry:
    """Batch rules by target. Modules are looked up along the MRO (the most specific registered
    class wins) unless registered with ``subclasses=False``; ATen overloads fall back to their packet."""

    functions: dict[Any, Rule] = field(default_factory=dict)
    methods: dict[str, Rule] = field(default_factory=dict)
    modules: dict[type[nn.Module], tuple[Rule, bool]] = field(default_factory=dict)
    # third-party functions by qualified name (``torchvision.ops.stochastic_depth.stochastic_depth``),
    # so the library registers rules for them without importing their package
    by_name: dict[str, Rule] = field(default_factory=dict)

    def register_by_name(self, qualified_name: str, rule: Rule, *, replace: bool = False) -> None:
        """Use ``rule`` for the function whose ``f"{__module__}.{__qualname__}"`` is ``qualified_name``."""
        if qualified_name in self.by_name and not replace:
            raise ValueError(f"{qualified_name!r} already has a batch rule; pass replace=True to override it")
        self.by_name[qualified_name] = rule

    def register(self, target: Any, rule: Rule, *, subclasses: bool = True, replace: bool = False) -> None:
        """Use ``rule`` for ``target``: a callable or ATen op (``call_function``), a method name
        (``call_method``) or an ``nn.Module`` subclass (``call_module``; ``subclasses=False`` for
        that exact type only). Registering a target twice is an error unless ``replace=True``."""
        if isinstance(target, str):
            table: dict[Any, Any] = self.methods
            entry: Any = rule
        elif isinstance(target, type) and issubclass(target, nn.Module):
            table, entry = self.modules, (rule, subclasses)
        elif callable(target) or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            table, entry = self.functions, rule
        else:
            raise ArgumentError(f"cannot register a batch rule for {target!r}: not a function, method name or module type")
        if target in table and not replace:
            raise ValueError(f"{target!r} already has a batch rule; pass replace=True to override it")
        table[target] = entry

    def register_family(self, family: OpFamily, rule: Rule) -> None:
        """Use ``rule`` for every member of an op family of :mod:`dpcompile.analysis.ops`."""
        for target in family:
            self.register(target, rule)

    def function_rule(self, target: Any) -> Rule | None:
        """The rule of a ``call_function`` target (an ATen overload falls back to its packet's)."""
        try:
            rule = self.functions.get(target)
        except TypeError:  # an unhashable target
            return None
        if rule is None and isinstance(target, torch._ops.OpOverload):
            rule = self.functions.get(target.overloadpacket)
        if rule is None and self.by_name:
            module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
            if isinstance(module, str) and isinstance(name, str):
                rule = self.by_name.get(f"{module}.{name}")
        return rule

    def module_rule(self, module: nn.Module) -> Rule | None:
        """The rule of the most specific registered class of ``module`` (exact-type entries match only it)."""
        for depth, cls in enumerate(type(module).__mro__):
            entry = self.modules.get(cls)
            if entry is not None and (depth == 0 or entry[1]):
                return entry[0]
            by_name = self.by_name.get(f"{cls.__module__}.{cls.__qualname__}") if self.by_name else None
            if by_name is not None:  # a third-party module class, registered without importing it
                return by_name
        return None

    def lookup(self, node: fx.Node, module: nn.Module | None = None) -> Rule | None:
        """The rule for ``node`` (``module``: the module a ``call_module`` node calls), or ``None``."""
        if node.op == "call_module":
            return self.module_rule(module) if module is not None else None
        if node.op == "call_function":
            return self.function_rule(node.target)
        if node.op == "call_method":
            return self.methods.get(node.target)
        return None


BATCH_RULES = BatchRuleRegistry()
