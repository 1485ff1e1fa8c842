"""Which modules ``activation_checkpointing=`` recomputes: the user's list checked against the
model, or (``True``) every repeated block.

>>> import torch.nn as nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
>>> repeated_blocks(model)
('1.0', '1.1', '1.2')
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import nn

from dpcompile.errors import ArgumentError, DpCompileError

#: what a recomputed region keeps for backward (``passes.checkpoint_saves``)
SAVE_RULES = ("nothing", "matmuls", "every_second_matmul", "auto")
_SPEC_KEYS = {"regions", "save", "budget", "budget_bytes", "row_bytes", "budget_over", "tiles"}
#: ``"budget_over"``: one knapsack per region (the same fraction in each), or over all of a device's regions
BUDGET_SCOPES = ("region", "device")
#: ``"auto"`` without ``budget``: keep half of what ``"matmuls"`` keeps, chosen to recompute the fewest FLOPs
DEFAULT_BUDGET = 0.5


def _regions_and_rule(activation_checkpointing: Any) -> tuple[Any, str]:
    """``activation_checkpointing=`` split into the regions it names and the save rule."""
    if not isinstance(activation_checkpointing, dict):
        return activation_checkpointing, "nothing"
    unknown = set(activation_checkpointing) - _SPEC_KEYS
    if unknown or "regions" not in activation_checkpointing:
        raise ArgumentError(
            f"activation_checkpointing={activation_checkpointing!r}: a dict takes 'regions' (True or module paths) "
            f"and 'save' (one of {list(SAVE_RULES)}), e.g. {{'regions': True, 'save': 'matmuls'}} or "
            "{'regions': True, 'save': 'auto', 'budget': 0.5}; also 'budget_over' ('region' or 'device') and 'tiles' "
            "(token slices a per-token region runs in)"
        )
    rule = activation_checkpointing.get("save", "nothing")
    if rule not in SAVE_RULES:
        raise ArgumentError(
            f"activation_checkpointing 'save': {rule!r} is not a rule; one of {list(SAVE_RULES)} ('matmuls': "
            "matmul and attention outputs kept, norms, activations and elementwise ops recomputed)"
        )
    if rule == "auto" and "budget_bytes" in activation_checkpointing:
        rule = _byte_rule(activation_checkpointing)
    elif rule == "auto":
        rule = f"auto:{_budget(activation_checkpointing.get('budget', DEFAULT_BUDGET))}"
    elif "budget" in activation_checkpointing or "budget_bytes" in activation_checkpointing:
        key = "budget" if "budget" in activation_checkpointing else "budget_bytes"
        raise ArgumentError(
            f"activation_checkpointing {key!r} goes with 'save': 'auto' (the rule that chooses what to keep "
            f"within it), not with {rule!r}: give {{'save': 'auto', {key!r}: ...}} or drop {key!r}"
        )
    rule += _scope_and_tiles(activation_checkpointing, rule)
    regions = activation_checkpointing["regions"]
    if regions is False or regions is None or regions == "auto" or isinstance(regions, str):
        hint = f" (a list: ['{regions}'])" if isinstance(regions, str) and regions != "auto" else ""
        raise ArgumentError(
            f"activation_checkpointing 'regions': {regions!r}; give True (every repeated block) or a list of module "
            f"paths{hint}"
        )
    return regions, rule


def check_spec(activation_checkpointing: Any) -> None:
    """The ``ValueError`` a malformed ``activation_checkpointing=`` dict gets, raised before anything
    is sized from the examples (so the message shows the dict as the user gave it)."""
    _regions_and_rule(activation_checkpointing)


def _scope_and_tiles(spec: dict[str, Any], rule: str) -> str:
    """The rule's suffix for ``"budget_over"`` (``"@device"``) and ``"tiles"`` (``";tiles=4"``)."""
    suffix = ""
    scope = spec.get("budget_over", "region")
    if scope not in BUDGET_SCOPES or (scope == "device" and not rule.startswith("auto:")):
        raise ArgumentError(
            f"activation_checkpointing 'budget_over': {scope!r}; give 'region' (each region keeps the same fraction) "
            "or 'device' (one knapsack over a device's regions), with 'save': 'auto'"
        )
    if scope == "device":
        suffix += "@device"
    tiles = spec.get("tiles", 1)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ArgumentError(
            f"activation_checkpointing 'tiles': {tiles!r}; give a whole number of token slices (e.g. 4) that each "
            "region acting on each token alone (an MLP) runs in, or leave it out"
        )
    if tiles > 1:
        suffix += f";tiles={tiles}"
    return suffix


def parse_save_rule(rule: str) -> tuple[str, bool, int]:
    """``checkpoint_save_rule``'s string split into the save rule, whether its budget spans a device's
    regions, and the token tiles: ``"auto:0.8@device;tiles=4"`` -> ``("auto:0.8", True, 4)``."""
    rule, _, tiles = rule.partition(";tiles=")
    rule, _, scope = rule.partition("@")
    return rule, scope == "device", int(tiles) if tiles else 1


def parse_bytes(size: Any, what: str) -> int:
    """``40960``, ``"40KiB"``, ``"1.5 MB"``: bytes, 0 allowed (``ValueError`` saying what to give)."""
    from dpcompile.analysis.memory import parse_budget

    if isinstance(size, int) and not isinstance(size, bool) and size == 0:
        return 0
    try:
        return parse_budget(size)
    except ValueError:
        raise ArgumentError(f"activation_checkpointing {what!r}: {size!r}; give bytes (an int, 0 or more) or a size "
                         "such as '40MiB'") from None  # fmt: skip


def _byte_rule(spec: dict[str, Any]) -> str:
    """``{"save": "auto", "budget_bytes": n}`` as ``"auto:bytes=n"``, with ``/row=r`` where the bytes
    of one value per row (a token) on a device are known (``"row_bytes"``, which ``transform`` sets
    from ``example_inputs=``)."""
    if "budget" in spec:
        raise ArgumentError("activation_checkpointing: give 'budget' (a fraction) or 'budget_bytes' (bytes), not both")
    rule = f"auto:bytes={parse_bytes(spec['budget_bytes'], 'budget_bytes')}"
    if spec.get("row_bytes") is not None:
        row = spec["row_bytes"]
        if isinstance(row, bool) or not isinstance(row, (int, float)) or row <= 0:
            raise ArgumentError(f"activation_checkpointing 'row_bytes': {row!r}; give the bytes one value per row "
                             "(token) takes on a device, or leave it out and give example_inputs=")  # fmt: skip
        rule += f"/row={row}"
    return rule


def byte_budget(rule: str) -> tuple[int, float | None] | None:
    """``"auto:bytes=4096/row=128"`` -> ``(4096, 128.0)``; None for a rule without a byte budget."""
    if not rule.startswith("auto:bytes="):
        return None
    size, _, row = rule.removeprefix("auto:bytes=").partition("/row=")
    return int(size), float(row) if row else None


def _budget(budget: Any) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ArgumentError(
            f"activation_checkpointing 'budget': {budget!r}; give a fraction from 0 (keep nothing, recompute the "
            "whole region) to 1 (keep what 'matmuls' keeps) of the matmul and attention outputs backward reads"
        )
    return float(budget)


def checkpoint_save_rule(activation_checkpointing: Any) -> str:
    """What each recomputed region keeps: ``activation_checkpointing["save"]``, else ``"nothing"``;
    ``"auto"`` is spelled with its budget, ``"auto:0.5"``."""
    return _regions_and_rule(activation_checkpointing)[1]



def _save_words(rule: str) -> str:
    """Words for a save rule: ``"auto:0.5"`` reads ``"the matmuls ... budget 0.5"``; ``"@device"``
    and ``";tiles=4"`` (``parse_save_rule``) add theirs."""
    rule, over_device, tiles = parse_save_rule(rule)
    if rule.startswith("auto:"):
        from dpcompile.analysis.memory import format_bytes

        scope = " of each device's regions" if over_device else ""
        sized = byte_budget(rule)
        budget = f"{format_bytes(sized[0])} per region and device" if sized else f"budget {rule.removeprefix('auto:')}"
        words = f"the matmul and attention outputs sparing the most FLOPs within {budget}{scope}"
    else:
        words = rule.replace("_", " ")
    return words + (f"; per-token regions in {tiles} token tiles" if tiles > 1 else "")


def checkpoint_words(rule: str, paths: tuple[str, ...], program: nn.Module) -> str:
    """``pm.strategies["activation_checkpointing"]``: what is recomputed, what it keeps, and which
    regions ``tiles`` left whole and why (their region modules' ``untiled_reason``)."""
    kept = "" if rule == "nothing" else f" (keeping {_save_words(rule)})"
    words = f"recompute in backward{kept}: {', '.join(paths)}"
    whole = {n.removesuffix("_region"): m.untiled_reason for n, m in program.named_children()
             if getattr(m, "untiled_reason", None)}  # fmt: skip
    if whole:
        words += f" (run whole, not in tiles: {'; '.join(f'{name}: {why}' for name, why in whole.items())})"
    return words


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The items of the model's largest ``ModuleList`` / ``Sequential`` of blocks of one type
    (the most items; ties: the most parameters); where no list holds any, not even one block
    (:func:`lone_blocks`), :func:`sibling_blocks`."""
    best: tuple[int, int, str, list[str]] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1 or not any(True for _ in next(iter(module)).parameters()):
            continue
        size = sum(p.numel() for p in module.parameters())
        names = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
        if best is None or (len(names), size) > best[:2]:
            best = (len(names), size, path, names)
    if best:
        return tuple(best[3])
    return () if lone_blocks(model) else sibling_blocks(model)  # a one-layer BART's layers, not its two attentions


def sibling_blocks(model: nn.Module) -> tuple[str, ...]:
    """The largest group of one module's own attributes that are blocks (submodules and parameters)
    of one type with parameters of the same shapes (``self.block0 = Block(); self.block1 = Block()``),
    the most first (ties: the most parameters), where they hold at least half the model's parameters;
    empty where there is none. Lists are
    :func:`repeated_blocks`' own; a Linear beside a Linear is no block.

    >>> sibling_blocks(PlainAttrs())  # inp, block0, block1, block2, out  # doctest: +SKIP
    ('block0', 'block1', 'block2')
    """
    best: tuple[int, int, list[str]] | None = None
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[Any, list[nn.Module]] = {}
        names: dict[int, str] = {}
        for name, child in module.named_children():
            if any(True for _ in child.children()) and any(True for _ in child.parameters()):
                shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters())
                groups.setdefault((type(child), shapes), []).append(child)
                names[id(child)] = f"{path}.{name}" if path else name
        for children in groups.values():
            size = sum(p.numel() for c in children for p in c.parameters())
            if len(children) > 1 and (best is None or (len(children), size) > best[:2]):
                best = (len(children), size, [names[id(c)] for c in children])
    whole = sum(p.numel() for p in model.parameters())
    # the model's own blocks hold most of it: not, say, Inception's four parallel 1x1 convolutions of one branch
    return tuple(best[2]) if best and 2 * best[1] >= whole else ()


def lone_blocks(model: nn.Module) -> tuple[str, ...]:
    """The item of every one-item ``ModuleList`` / ``Sequential`` whose item is a block (it holds
    parameters and submodules), outermost only: a one-layer BART's ``model.encoder.layers.0`` and
    ``model.decoder.layers.0``, or ALBERT's one layer group that every layer runs
    (``albert.encoder.albert_layer_groups.0``, its inner one-item list left out as part of it)."""
    found: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) != 1:
            continue
        name, block = next(iter(module.named_children()))
        item = f"{path}.{name}" if path else name
        inside = any(item.startswith(f"{outer}.") for outer in found)
        if not inside and any(True for _ in block.children()) and any(True for _ in block.parameters()):
            found.append(item)
    return tuple(found)


def checkpoint_paths(model: nn.Module, activation_checkpointing: Any) -> tuple[str, ...]:
    """The module paths to recompute in backward for ``activation_checkpointing=`` (False: none).

    An unknown path is an ``ArgumentError`` (a ``ValueError``) naming the nearest ones; ``True`` on a model without
    repeated blocks is a ``DpCompileError`` saying to name the modules. Where the blocks are lists
    of one item (a one-layer encoder-decoder, ALBERT's shared layer run by every layer), ``True``
    recomputes those items (:func:`lone_blocks`).
    """
    activation_checkpointing, _ = _regions_and_rule(activation_checkpointing)
    if activation_checkpointing is None or activation_checkpointing is False:
        return ()
    if activation_checkpointing == "auto":
        raise DpCompileError(
            'activation_checkpointing="auto" chooses what to recompute so that the program fits memory_per_device=, '
            "and there is no budget: pass memory_per_device= too, or True (every repeated block), or the module "
            "paths to recompute"
        )
    if activation_checkpointing is True:
        blocks = repeated_blocks(model) or lone_blocks(model)
        if not blocks:
            raise DpCompileError(
                "activation_checkpointing=True recomputes the model's repeated blocks (a ModuleList or Sequential "
                f"of one block type, or attributes that are blocks of one type and shape), and {type(model).__name__} has none: name the modules to recompute, "
                f"e.g. activation_checkpointing={[name for name, _ in model.named_children()][:2] or ['encoder']!r}"
            )
        return blocks
    if isinstance(activation_checkpointing, str) or not isinstance(activation_checkpointing, (list, tuple)) or not all(
        isinstance(p, str) for p in activation_checkpointing
    ):
        raise ArgumentError(
            f"activation_checkpointing= regions {activation_checkpointing!r}: expected True (every repeated block) or "
            'a list of module paths (["layers.0", "layers.1"])'
        )
    known = {path for path, _ in model.named_modules() if path}
    paths = tuple(dict.fromkeys(activation_checkpointing))
    for path in paths:
        if path not in known:
            near = difflib.get_close_matches(str(path), sorted(known), n=3) or sorted(known)[:3]
            raise ArgumentError(
                f"activation_checkpointing names {path!r}, which is not a module of {type(model).__name__}; nearest: "
                f"{near} (paths as model.named_modules() spells them)"
            )
    return paths


__all__ = ["BUDGET_SCOPES", "byte_budget", "check_spec", "parse_bytes", "DEFAULT_BUDGET", "SAVE_RULES", "checkpoint_words", "parse_save_rule", "checkpoint_paths", "checkpoint_save_rule", "lone_blocks", "repeated_blocks"]
