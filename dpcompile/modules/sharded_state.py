"""The model's state dict for a program that stores parameters as pieces (``pm.param_shards``).

``state_dict()`` has the original model's keys (``pm.state_keys``), each a whole tensor put
together from its pieces (tensor-parallel shards, FSDP's pieces in one process, or both);
``load_state_dict`` cuts the pieces out of whole tensors. Mixed into
:class:`~dpcompile.modules.tensor_parallel.TensorParallelModule` and the one-process FSDP programs
(:mod:`dpcompile.modules.fsdp_one_process`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from dpcompile.modules.weights import state_dict_loaded
from dpcompile.runtime.tensor_parallel import ShardSpec, shard_of, unshard


class ShardedState:
    """``state_dict`` / ``load_state_dict`` under the model's keys for ``state_keys`` and ``param_shards``."""

    state_keys: list[str]
    param_shards: dict[str, tuple[ShardSpec, list[str]]]

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The original model's keys, each holding the full (gathered) tensor."""
        if args:  # the positional form nn.Module still accepts
            destination = args[0]
        own = super().state_dict(keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
        aliases = getattr(self, "state_aliases", {})
        for key in self.state_keys:
            source = key if key in self.param_shards or key in own else aliases.get(key, key)  # T5's `shared`, never called
            if source in self.param_shards:
                spec, names = self.param_shards[source]
                value = unshard([own[name] for name in names], spec, self.devices.primary)
                destination[prefix + key] = value if keep_vars else value.detach()
            elif source in own:
                destination[prefix + key] = own[source]
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors under the original keys, cutting the shards out of them. Every key is
        checked (a tensor, each piece of the shape it replaces) before the first is copied: a
        refused load changes nothing."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict).__name__}.")
        keys = set(self.state_keys)
        missing = [k for k in self.state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__} (nothing was loaded): missing keys "
                f"{missing}, unexpected keys {unexpected}"
            )
        own = super().state_dict(keep_vars=True)
        copies = []  # (destination, value), all checked first
        for key in self.state_keys:
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(f"{key} is a {type(value).__name__}, not a tensor (nothing was loaded)")
            if key in self.param_shards:
                spec, names = self.param_shards[key]
                expected = sum(spec.sizes)
                fits = value.dim() > spec.dim and value.size(spec.dim) == expected
                pieces = [shard_of(value, spec, k) for k in range(len(names))] if fits else []
                if not fits or any(piece.shape != own[name].shape for piece, name in zip(pieces, names)):
                    raise RuntimeError(
                        f"size mismatch for {key}: got {tuple(value.shape)}, the sharded parameter has "
                        f"{expected} along dim {spec.dim} (shards {list(spec.sizes)}) (nothing was loaded)"
                    )
                copies += [(own[name], piece) for name, piece in zip(names, pieces)]
            elif key in own:
                if own[key].shape != value.shape:
                    raise RuntimeError(
                        f"size mismatch for {key}: got {tuple(value.shape)}, expected {tuple(own[key].shape)} "
                        "(nothing was loaded)"
                    )
                copies.append((own[key], value))
        with torch.no_grad():
            for destination, value in copies:
                destination.copy_(value)
        state_dict_loaded(self, missing)  # a program built on meta holds its weights now
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
        """``parent.load_state_dict(...)`` of a module holding ``pm``: cut each full tensor under
        its original key into the shard keys the submodules load, before they load."""
        for key, (spec, names) in self.param_shards.items():
            value = state_dict.get(prefix + key)
            if not isinstance(value, torch.Tensor):
                continue
            del state_dict[prefix + key]
            if value.dim() <= spec.dim or value.size(spec.dim) != sum(spec.sizes):
                error_msgs.append(
                    f"size mismatch for {prefix + key}: got {tuple(value.shape)}, the sharded parameter has "
                    f"{sum(spec.sizes)} along dim {spec.dim} (shards {list(spec.sizes)})"
                )
                continue
            for k, name in enumerate(names):
                state_dict[prefix + name] = shard_of(value, spec, k)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


__all__ = ["ShardedState"]
