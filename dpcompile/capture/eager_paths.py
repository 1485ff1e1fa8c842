"""What torch.export would capture differently from eager, put back while it exports.

- ``nn.TransformerEncoder`` (``enable_nested_tensor=True``, batch first) with a padding mask takes,
  in eval without gradients, a nested-tensor fast path that returns zeros at the padded positions;
  export captures the slow path, which computes them. Each such encoder's output is followed by
  the same choice, made at each call as eager makes it
  (:func:`~dpcompile.runtime.nested_encoder.encoder_nested_path`)::

      before: out = encoder(src, src_key_padding_mask=mask)             # padded rows computed
      after:  out = where(encoder_nested_path(mask, ...), out.masked_fill(mask[..., None], 0), out)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dpcompile.capture.export_inputs import root_pre_hooks_given_positions
from dpcompile.runtime.nested_encoder import encoder_nested_path


@contextlib.contextmanager
def export_as_eager_runs(model: nn.Module, positional: Sequence[str]) -> Iterator[None]:
    """While exporting ``model``: root pre-hooks see the positional examples, nested encoders zero their padding."""
    with root_pre_hooks_given_positions(model, positional), nested_encoders_as_eager(model), gradients_refused(model):
        yield


@contextlib.contextmanager
def gradients_refused(model: nn.Module) -> Iterator[None]:
    """``torch.autograd.grad`` called in forward while torch.export traces it (a gradient penalty, an energy
    model's ``-grad(e, x)``) is refused naming its line: export cannot capture it (a bare "fake tensor in the
    exported program constant's list" before), while the fx frontend runs it."""
    from dpcompile.capture.errors import is_library_file
    from dpcompile.errors import TraceError

    original = torch.autograd.grad

    def refused(*args: Any, **kwargs: Any) -> Any:  # export's error names the line
        if is_library_file(sys._getframe(1).f_code.co_filename):  # dpcompile's probe of an autograd.Function
            return original(*args, **kwargs)
        raise TraceError(
            f"{type(model).__name__}.forward takes a gradient with torch.autograd.grad, which torch.export cannot "
            "capture; transform with frontend='fx', which runs it"
        )

    torch.autograd.grad = refused
    try:
        yield
    finally:
        torch.autograd.grad = original


@contextlib.contextmanager
def nested_encoders_as_eager(model: nn.Module) -> Iterator[None]:
    encoders = [m for m in model.modules() if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)]
    patched = [m for m in encoders if "forward" not in m.__dict__]
    for encoder in patched:
        encoder.forward = _zeroing_padding_as_eager(encoder)
    try:
        yield
    finally:
        for encoder in patched:
            del encoder.forward


def _zeroing_padding_as_eager(encoder: nn.TransformerEncoder) -> Any:
    original = type(encoder).forward

    def forward(src: torch.Tensor, mask: Any = None, src_key_padding_mask: Any = None, is_causal: Any = None) -> Any:
        if src_key_padding_mask is None or mask is not None or src.dim() != 3:
            return original(encoder, src, mask, src_key_padding_mask, is_causal)
        norm = encoder.norm  # eager pads with zeros, then norms: a padded row is norm(0), its bias for a LayerNorm
        encoder.norm = None
        try:
            out = original(encoder, src, mask, src_key_padding_mask, is_causal)
        finally:
            encoder.norm = norm
        if not isinstance(out, torch.Tensor):
            return out if norm is None else norm(out)
        first = encoder.layers[0]
        weights = [p for m in (first.self_attn, first.norm1, first.norm2, first.linear1, first.linear2) for p in m.parameters()]
        needs_grad = src.requires_grad or any(p.requires_grad for p in weights)
        padded = src_key_padding_mask if src_key_padding_mask.dtype == torch.bool else src_key_padding_mask != 0
        nested = encoder_nested_path(padded, first.training, needs_grad, getattr(encoder, "mask_check", True))
        out = torch.where(nested, out.masked_fill(padded.unsqueeze(-1), 0.0), out)
        return out if norm is None else norm(out)

    return forward
