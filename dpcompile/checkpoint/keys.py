"""Which checkpoint tensor fills which of the model's keys, as ``from_pretrained`` decides it.

A checkpoint key that is one of the model's keys fills it. Any other goes through the renamings
transformers applies when it loads (``transformers.conversion_mapping.get_model_conversion_mapping``:
the model's own conversions, ``key_mapping=``, the legacy ``LayerNorm.gamma``/``beta`` names),
as ``transformers.core_model_loading.rename_source_key`` renames it: a renamed key is read as
any other (slices for a shard); a key a ``WeightConverter`` merges or splits (per-expert weights
stacked into one tensor, a fused ``qkv`` split) is gathered with the others of its target into
a :class:`Conversion`, run on meta tensors to check shapes before any read, and on the real
tensors when written. Keys still not placed are returned, to be named.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpcompile.checkpoint.headers import CheckpointError, Entry


@dataclass
class Conversion:
    """The checkpoint tensors a transformers ``WeightConverter`` turns into model keys."""

    converter: Any
    first: str  # the first target key, as transformers names the conversion
    sources: list[tuple[str, Entry, str]] = field(default_factory=list)  # (target key, entry, source pattern)
    model: nn.Module | None = None

    def run(self, read: Callable[[Entry], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{model key: tensor}``, each source read by ``read(entry)``."""
        converter = copy.deepcopy(self.converter)
        for target, entry, pattern in self.sources:
            converter.add_tensor(target, entry.key, pattern, lambda entry=entry: read(entry))
        try:
            out = converter.convert(self.first, model=self.model, config=getattr(self.model, "config", None))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the conversion names its tensors
            entry = self.sources[0][1]
            raise CheckpointError(
                f"{entry.file}: the tensors {[e.key for _, e, _ in self.sources][:6]} cannot be converted to "
                f"'{self.first}' as transformers converts them ({type(e).__name__}: {e})",
                file=entry.file, key=entry.key,
            ) from None  # fmt: skip
        return {key: (value[0] if isinstance(value, list) else value) for key, value in out.items()}


@dataclass
class Placement:
    """``direct``: ``{model key: entry}`` read as they are; ``converted``: ``{model key: Conversion}``;
    ``unplaced``: checkpoint keys no model key takes; ``renamed``: ``{checkpoint key: model key}``."""

    direct: dict[str, Entry] = field(default_factory=dict)
    converted: dict[str, Conversion] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)

    def placed(self, key: str) -> bool:
        return key in self.direct or key in self.converted


def place_keys(
    entries: Mapping[str, Entry],
    model_keys: Collection[str],
    model: nn.Module | None,
    key_mapping: Mapping[str, str] | None = None,
) -> Placement:
    """Where each checkpoint key goes among ``model_keys`` (the program's state keys and the
    non-persistent buffers it waits for)."""
    out = Placement()
    keys = set(model_keys)
    rest = [k for k in entries if k not in keys]
    out.direct.update((k, entries[k]) for k in entries if k in keys)
    if not rest:
        return out
    rename = _renamer(model, keys, key_mapping)
    if rename is None:
        out.unplaced = rest
        return out
    for key in sorted(rest, key=_natural_key):
        target, pattern, converter = rename(key)
        if target not in keys:
            out.unplaced.append(key)
        elif converter is None:
            if target in out.direct:
                raise CheckpointError(
                    f"both '{out.direct[target].key}' and '{key}' of {entries[key].file.parent} fill the model's "
                    f"'{target}' (the latter by transformers' renaming): remove one",
                    file=entries[key].file, key=key,
                )  # fmt: skip
            out.direct[target] = entries[key]
            out.renamed[key] = target
        else:
            conversion = out.converted.setdefault(target, Conversion(converter, target, model=model))
            conversion.sources.append((target, entries[key], pattern))
            out.renamed[key] = target
    return out


def _renamer(
    model: nn.Module | None, keys: set[str], key_mapping: Mapping[str, str] | None
) -> Callable[[str], tuple[str, str | None, Any]] | None:
    """``rename(checkpoint key) -> (model key, source pattern, converter or None)`` as transformers
    renames on load; None where there is nothing to rename with."""
    if "transformers" not in sys.modules:  # no model of transformers' then: not worth its import
        return _plain_renamer(model, key_mapping)
    try:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return _plain_renamer(model, key_mapping)
    mapping = _transformers_mapping(model, key_mapping)
    if not mapping:
        return None
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    present = dict.fromkeys(keys, True)

    def rename(key: str) -> tuple[str, str | None, Any]:
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        return target, pattern, None if pattern is None else by_pattern[pattern]

    return rename


def _transformers_mapping(model: nn.Module | None, key_mapping: Mapping[str, str] | None) -> list[Any]:
    """transformers' conversions for ``model`` (its own, ``key_mapping=``, the legacy names)."""
    from transformers.core_model_loading import WeightRenaming

    mapping: list[Any] = []
    legacy = getattr(model, "_checkpoint_conversion_mapping", None)  # transformers 4's class attribute
    for patterns in (key_mapping, legacy if isinstance(legacy, Mapping) else None):
        mapping += [WeightRenaming(source_patterns=k, target_patterns=v) for k, v in (patterns or {}).items()]
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return mapping
    if isinstance(model, PreTrainedModel):
        mapping += list(get_model_conversion_mapping(model, add_legacy=True))
    return mapping


def _plain_renamer(model: nn.Module | None, key_mapping: Mapping[str, str] | None) -> Any:
    """Without transformers: ``key_mapping`` (and a model's ``_checkpoint_conversion_mapping``) as regexes."""
    legacy = getattr(model, "_checkpoint_conversion_mapping", None)
    patterns = {**(key_mapping or {}), **(legacy if isinstance(legacy, Mapping) else {})}
    if not patterns:
        return None

    def rename(key: str) -> tuple[str, None, None]:
        for pattern, replacement in patterns.items():
            key = re.sub(pattern, replacement, key)
        return key, None, None

    return rename


def _natural_key(key: str) -> list[tuple[Any, ...]]:
    """``experts.2`` before ``experts.10``, as transformers orders the keys it merges."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


__all__ = ["Conversion", "Placement", "place_keys"]
