"""Run a program once on fake tensors (or, where they fail, for real without grad) and record
per node its shapes, dtypes, bytes, FLOPs and devices, and per collective its size."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dpcompile.analysis.cost import comm_sizes
from dpcompile.errors import first_line
from dpcompile.fx_utils import FreshArguments, is_example_misfit, quiet_fake_tensor_log
from dpcompile.modules.call_errors import call_failed
from dpcompile.runtime.structures import is_fake, tensor_leaves

__all__ = ["Recorder", "propagate"]

log = logging.getLogger("dpcompile")


class Recorder(FreshArguments):
    """Run the program once, recording a summary per node (not the values themselves).

    ``summaries[name]`` is ``(shapes, dtypes, bytes)``, ``flops[name]`` the FLOPs that
    ``flop_counter`` saw, ``devices[name]`` the output tensors' devices, ``sizes[name]``
    a collective's ``(S forward, S backward)`` (:func:`dpcompile.analysis.cost.comm_sizes`),
    ``current`` the node running (the one that failed, after an error).
    """

    def __init__(self, gm: fx.GraphModule, flop_counter: Any | None):
        super().__init__(gm, garbage_collect_values=True)
        self.flop_counter = flop_counter
        self.summaries: dict[str, tuple[list[list[int]], list[str], int]] = {}
        self.flops: dict[str, int] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        self.devices: dict[str, list[str]] = {}
        self.current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        before = self.flop_counter.get_total_flops() if self.flop_counter is not None else 0
        result = super().run_node(n)
        if self.flop_counter is not None:
            self.flops[n.name] = int(self.flop_counter.get_total_flops() - before)
        leaves = [t for _, t in tensor_leaves(result)] if n.op != "get_attr" else []
        self.summaries[n.name] = (
            [list(t.shape) for t in leaves],
            [str(t.dtype).replace("torch.", "") for t in leaves],
            sum(t.numel() * t.element_size() for t in leaves),
        )
        self.devices[n.name] = [str(t.device) for t in leaves]
        if "dpcompile_comm" in n.meta:
            args, _ = self.fetch_args_kwargs_from_env(n)
            try:
                sizes = comm_sizes(n, args, result)
                if sizes is not None:
                    self.sizes[n.name] = sizes
            except Exception as e:  # noqa: BLE001 - a cost figure must not stop the explanation
                log.debug("cannot size collective %s: %s", n.name, e)
        return result


def _snapshot_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers() if not is_fake(b)]


def _restore_buffers(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in saved:
            if not torch.equal(buffer, value):
                buffer.copy_(value)


def propagate(gm: fx.GraphModule, inputs: list[Any]) -> tuple[Recorder | None, str]:
    """Record ``gm`` run on ``inputs``: ``(recorder, "fake")``, ``(recorder, "real")`` where fake
    tensors fail, ``(None, "none")`` where both fail. Buffers (BatchNorm statistics) are left as
    they were."""
    saved = _snapshot_buffers(gm)
    try:
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode  # looked up per call: tests replace it

            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
            with quiet_fake_tensor_log(), mode, FlopCounterMode(display=False) as counter:
                recorder = Recorder(gm, counter)
                recorder.run(*fake_inputs)
            return recorder, "fake"
        except Exception as e:  # noqa: BLE001 - fall back to real (no-grad) propagation
            log.info(
                "explain: fake-tensor propagation failed (%s: %s); running for real", type(e).__name__, first_line(e)
            )
        _restore_buffers(saved)
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                recorder = Recorder(gm, counter)
                recorder.run(*inputs)
            return recorder, "real"
        except Exception as e:  # noqa: BLE001 - explain what can be explained without shapes
            refused = call_failed(gm.graph, e, tuple(inputs), {}) if inputs and is_example_misfit(e) else None
            if refused is not None:  # inputs the program cannot take (a width, a dtype, a None): said, not shapeless
                raise refused from e
            log.warning(
                "explain: shape propagation failed (%s: %s); reporting without shapes", type(e).__name__, first_line(e)
            )
            return None, "none"
    finally:
        _restore_buffers(saved)
