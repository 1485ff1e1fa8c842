"""Whether eager's ``nn.TransformerEncoder`` takes its nested-tensor fast path at a call, decided at
run time as eager decides it. That path returns zeros at the padded positions of
``src_key_padding_mask``; the slow path, which torch.export captures, computes them::

    out = encoder(src, src_key_padding_mask=mask)          # eval, under no_grad: out[mask] == 0

The program keeps the captured path and zeroes the padded rows where eager would have taken it
(``torch.where(encoder_nested_path(mask, ...), out.masked_fill(...), out)``)."""

from __future__ import annotations

import torch

from dpcompile.errors import DpCompileError


@torch.library.custom_op("dpcompile::encoder_nested_path", mutates_args=())
def encoder_nested_path(padding_mask: torch.Tensor, training: bool, needs_grad: bool, mask_check: bool) -> torch.Tensor:
    """A 0-dim bool: eager's TransformerEncoder would convert to a nested tensor at this call (eval,
    fast path on, no autocast, no gradient needed, the padding at the end of every row)."""
    if training or not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled():
        return torch.zeros((), dtype=torch.bool, device=padding_mask.device)
    if needs_grad and torch.is_grad_enabled():
        return torch.zeros((), dtype=torch.bool, device=padding_mask.device)
    valid = padding_mask.logical_not()
    left_aligned = bool((valid[:, :-1] | valid[:, 1:].logical_not()).all()) if valid.size(1) > 1 else True
    if mask_check and not left_aligned:
        return torch.zeros((), dtype=torch.bool, device=padding_mask.device)
    if not left_aligned:
        raise DpCompileError(
            "nn.TransformerEncoder(mask_check=False) was given a padding mask whose padding is not at the end of "
            "each row: eager's fast path then reads the wrong tokens; pad at the end, or build it with mask_check=True"
        )
    return torch.ones((), dtype=torch.bool, device=padding_mask.device)


@encoder_nested_path.register_fake
def _(padding_mask: torch.Tensor, training: bool, needs_grad: bool, mask_check: bool) -> torch.Tensor:
    return torch.empty((), dtype=torch.bool, device=padding_mask.device)
