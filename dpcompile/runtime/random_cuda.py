"""Attention dropout on CUDA as eager's fused kernel draws it (``exact_random=True``).

On CUDA ``F.scaled_dot_product_attention(..., dropout_p=p)`` runs a fused kernel that draws its own
mask from the device's Philox generator; the written-out math kernel of
:func:`~dpcompile.runtime.random.exact_attention` must multiply by that mask:

- the math kernel (float64, or no fused kernel fits): dropout of ones, the fused dropout's mask;
- the memory-efficient kernel (float32 on recent GPUs): the kernel's own mask, rebuilt by
  ``aten._fill_mem_eff_dropout_mask_`` from the Philox seed and offset the kernel reads. A kernel
  call on zeros of the whole ``[B, H, L, 8]`` shape reports them and leaves the generator where
  eager's kernel leaves it (one draw per attention element, whatever the head size);
- the flash and cuDNN kernels (float16, bfloat16): their masks are not reproduced. The site warns
  once and draws dropout of ones: the values and the generator's offset differ from eager's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_WARNED: set[str] = set()


def attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                     dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> str:  # fmt: skip
    """The kernel eager ``scaled_dot_product_attention`` runs for these arguments: ``"math"``,
    ``"flash"``, ``"efficient"``, ``"cudnn"`` (``"math"`` off CUDA or where the choice cannot be read)."""
    if query.device.type != "cuda":
        return "math"
    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)  # fmt: skip
    except (RuntimeError, TypeError):
        return "math"
    names = {1: "flash", 2: "efficient", 3: "cudnn"}
    return names.get(int(choice), "math")


def mem_efficient_noise(p: float, dtype: torch.dtype, device: torch.device) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """The memory-efficient kernel's dropout on a whole ``[B, H, L, S]`` attention, as ``mask / (1 - p)``."""

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        *batch, length, keys = shape
        zeros_q = torch.zeros(*batch, length, 8, dtype=torch.float32, device=device)
        zeros_k = torch.zeros(*batch, keys, 8, dtype=torch.float32, device=device)
        _, _, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            zeros_q, zeros_k, zeros_k, None, False, p, False
        )  # advances the generator as eager's kernel does, and says where it drew
        uniform = torch.empty(shape, dtype=torch.float32, device=device)
        uniform = torch.ops.aten._fill_mem_eff_dropout_mask_(uniform, p, int(seed), int(offset))
        return (uniform > p).to(dtype).div_(1.0 - p)

    return draw


def attention_noise(site: str, kernel: str, attn: torch.Tensor, p: float,
                    dropout_of_ones: Callable[[tuple[int, ...]], torch.Tensor]) -> Callable[[tuple[int, ...]], torch.Tensor]:  # fmt: skip
    """How the attention dropout of ``site`` draws its whole noise for eager's ``kernel``."""
    if kernel == "efficient" and attn.dim() == 4:
        return mem_efficient_noise(p, attn.dtype, attn.device)
    if kernel in ("flash", "cudnn", "efficient") and site not in _WARNED:
        _WARNED.add(site)
        warnings.warn(
            f"dpcompile: attention dropout at {site!r} runs on CUDA where eager runs the {kernel} kernel "
            f"({attn.dtype}, {attn.dim()}-d), whose dropout mask is not reproduced: its values and the CUDA "
            "generator's offset differ from a single-device run. Use float32 (the memory-efficient kernel, "
            "reproduced), or exact_random=False to say so",
            stacklevel=3,
        )
    return dropout_of_ones


def dropout_of_ones(like: torch.Tensor, p: float) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """Dropout of ones on ``like``'s device: on CUDA the fused dropout's mask and Philox stream."""
    return lambda shape: F.dropout(torch.ones(shape, dtype=like.dtype, device=like.device), p, True)


__all__ = ["attention_kernel", "attention_noise", "dropout_of_ones", "mem_efficient_noise"]
