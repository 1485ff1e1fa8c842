"""Weight normalisations the tracer must treat apart: a parametrization holding state
(``torch.nn.utils.parametrizations.spectral_norm``) is traced into, so that its weight is computed
once per call; the older hook-based ``torch.nn.utils.spectral_norm`` is refused in training, and the
older ``weight_norm``'s computed weight is left out of the copies dpcompile makes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm

from dpcompile.errors import DpCompileError


def writes_parametrization_state(module: nn.Module) -> bool:
    """Whether ``module`` has a parametrization holding buffers, which computing the weight may
    update (``spectral_norm``'s power iteration in training mode). Called as a leaf, such a module
    would compute its weight once per replica or micro-batch, updating them that many times."""
    if not parametrize.is_parametrized(module):
        return False
    return any(True for plist in module.parametrizations.values() for _ in plist.buffers())


def refuse_spectral_norm_hooks(root: nn.Module) -> None:
    """``torch.nn.utils.spectral_norm`` (the hook, not the parametrization): in training its forward
    pre-hook updates ``weight_u`` at each call of the module, which a program calls once per replica
    or micro-batch; refused by name, with the parametrization that runs once."""
    for path, module in root.named_modules():
        if module.training and any(isinstance(h, SpectralNorm) for h in module._forward_pre_hooks.values()):
            raise DpCompileError(
                f"'{path}' ({type(module).__name__}) uses torch.nn.utils.spectral_norm, whose forward pre-hook updates its "
                "power iteration's vectors at every call of the module, so a program that calls it once per replica or "
                "micro-batch would update them that many times. Use torch.nn.utils.parametrizations.spectral_norm (the same "
                "normalisation, computed once per call; its state_dict keys differ), or transform the model in eval mode"
            )


@contextlib.contextmanager
def parametrize_cache_off() -> Iterator[None]:
    """Tracing inside ``parametrize.cached()`` (a data_parallel="fsdp" program's call, which traces
    another mode) would cache a parametrized weight read while tracing as a proxy, for the run after."""
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


def computed_attributes_detached(module: nn.Module, memo: dict[int, Any], device: str | None = None) -> dict[int, Any]:
    """``copy.deepcopy``'s ``memo`` given a detached copy (on ``device``, or a clone) of each tensor a
    submodule holds as a plain attribute that autograd computed: the older ``torch.nn.utils.weight_norm``'s
    ``weight``, which its pre-hook computes again at each call, and which deepcopy refuses ("Only Tensors
    created explicitly by the user (graph leaves) support the deepcopy protocol")."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None and id(value) not in memo:
                memo[id(value)] = value.detach().to(device) if device else value.detach().clone()
    return memo


def deepcopy_module(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)``, a weight its hook computes (the older weight_norm's) included."""
    return copy.deepcopy(module, computed_attributes_detached(module, {}))
