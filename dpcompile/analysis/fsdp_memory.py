"""One-process FSDP over data parallelism (``data_parallel="fsdp"``, ``["cpu"] * n``): its bytes per device
at the peak of a step, from data parallel's prediction (:func:`dpcompile.analysis.layout_costs.predict`).

The program (:mod:`dpcompile.modules.fsdp_one_process`) stores each parameter as one piece per device and
gathers it whole on the first device where a call first reads it; the gathers are held until the call
returns (one a parameter a call, whichever copy reads it), and what autograd saves of them is gathered
again in backward, one at a time. So per device:

- its pieces (and the optimizer's state of them), through the step;
- the first device: backward as data parallel's (the moments of its sweep): each parameter's whole
  gradient is summed where it was gathered, its pieces' gradients views of it; and one moment more, as
  forward returns: every parameter it gathered, whole, beside every activation saved (its share of
  the batch). Measured so (torchvision's ViT -2.2%, the MLP stack -0.8%, GPT-2 -4.0%);
- another device: data parallel's sweep with no parameter's gradient held (each is summed on the first
  device), and beside it the largest module's weight regathered and its whole gradient (torchvision's
  ViT's 1000-class head, as its backward starts: +1.3%; an upper bound where the peak is elsewhere: a
  2-block MLP of width 32-128 +8% to +16%).

Before (data parallel's prediction)::

    {"parameters": P, "gradients": g, "activations": a}                 # every device

After::

    {"parameters": piece_0, "gradients": g, "activations": a}           # device 0, backward
    {"parameters": piece_0 + gathered, "activations": saved}            # device 0, as forward returns
    {"parameters": piece_r, "gradients": 2 * module, "activations": a'} # device r > 0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from dpcompile.analysis.layout_costs import LayoutSpec, batch_share, stage_memory
from dpcompile.analysis.model_profile import ModelProfile

__all__ = ["fsdp_one_process"]


def fsdp_one_process(
    profile: ModelProfile, spec: LayoutSpec, data_parallel: Sequence[Mapping[str, int]], pieces: Sequence[int],
    gathered: int,
) -> list[dict[str, int]]:  # fmt: skip
    """Bytes by kind per device (see the module's docstring): ``data_parallel``, data parallel's prediction
    of ``spec`` per device; ``pieces``, the parameter bytes each device stores; ``gathered``, the whole bytes
    of the parameters stored as pieces (those left whole on the first device, 0-dim or written in forward,
    are among its pieces and never gathered)."""
    whole = profile.total("param_bytes") or 1
    optimizer = profile.total("optimizer_bytes")
    share = batch_share(profile.batch, len(pieces))
    training = profile.training
    saved = round(profile.total("saved_bytes") * share) if training else 0
    # another device's sweep: its values' gradients beside its activations, no parameter's gradient held (each
    # is summed where it was gathered), but the module whose backward runs: its weight regathered, its gradient
    others = stage_memory([dataclasses.replace(u, grad_bytes=0) for u in profile.units], 1,
                          checkpointing=spec.checkpointing and training, share=share, rest=0.0, training=training,
                          sweep=True, accumulates=False)  # fmt: skip
    module = 2 * max((u.module_grad_bytes for u in profile.units), default=0) if training else 0
    out = []
    for r, (kinds, held) in enumerate(zip(data_parallel, pieces, strict=True)):
        state = round(optimizer * held / whole)
        if r == 0:  # backward as data parallel's; and as forward returns, the gathers held
            moments = [{**kinds, "parameters": held, "optimizer": state},
                       {"parameters": held + gathered, "gradients": 0, "optimizer": state, "activations": saved}]
        else:
            moments = [{"parameters": held, "gradients": others["gradients"] + module, "optimizer": state,
                        "activations": others["activations"]}]  # fmt: skip
        out.append(max(moments, key=lambda k: sum(k.values())))
    return out
