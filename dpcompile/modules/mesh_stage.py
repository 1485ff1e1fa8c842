"""What a pipeline over a mesh adds around ``torch.distributed.pipelining``'s ``PipelineStage``.

- **Uneven micro-batches.** A schedule sizes its receive buffers once, so the micro-batches of
  one step must be equal. ``micro_batch_runs`` cuts a batch as ``torch.tensor_split`` does (as
  the one-process pipeline does) into at most two runs of equal micro-batches; each run is one
  step of its own schedule, and the module adds the runs' loss sums, counts and gradients.
- **Only tensors on the wire.** ``PipelineStage`` sends tensors only; an int read from a shape or
  a ``torch.device`` that a later stage uses (transformers decoders pass both) is bound to its
  value for the run's micro-batch shape (``TensorsOnWire``): every rank works it out on fake tensors.
- **BatchNorm's statistics.** ``batch_norm_refusal``: why training BatchNorm needs one micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import writes
from dpcompile.runtime.structures import is_fake


def micro_batch_runs(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """``(count, size)`` runs of equal micro-batches, in batch order, with ``torch.tensor_split``'s
    sizes: ``batch % M`` micro-batches of ``batch // M + 1`` samples, then the rest of ``batch // M``.

    >>> micro_batch_runs(8, 4), micro_batch_runs(7, 4), micro_batch_runs(10, 4), micro_batch_runs(3, 4)
    ([(4, 2)], [(3, 2), (1, 1)], [(2, 3), (2, 2)], [(3, 1)])
    """
    n = min(batch, micro_batches)
    size, extra = divmod(batch, n)
    return [(count, rows) for count, rows in ((extra, size + 1), (n - extra, size)) if count]


class TensorsOnWire(nn.Module):
    """``program`` with only tensors in and out: inputs at ``bound`` (position → value) are not
    received but bound, and outputs that are not tensors (positions not in ``sent``) are not sent
    (the next stage binds them). The values are those of one micro-batch shape: one per run.
    ``sent=None``: every input received, every output sent (until :meth:`rewire`). Sent tensors are
    made contiguous (a send of a view, such as Llama's expanded rotary ``cos``/``sin``, fails)."""

    def __init__(self, program: fx.GraphModule, bound: dict[int, Any], arity: int, sent: tuple[int, ...] | None):
        super().__init__()
        self.program = program
        self.rewire(bound, arity, sent)

    def rewire(self, bound: dict[int, Any], arity: int, sent: tuple[int, ...] | None) -> None:
        """Bind and send as for another micro-batch shape (one module kept: FSDP wraps it once)."""
        self.bound, self.arity, self.sent = bound, arity, sent

    def forward(self, *received: Any) -> tuple:
        it = iter(received)
        args = [self.bound[i] if i in self.bound else next(it) for i in range(self.arity)] if self.bound else received
        outs = self.program(*args)
        sent = outs if self.sent is None else tuple(outs[i] for i in self.sent)
        return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in sent)  # sends need contiguous


def on_wire(
    program: fx.GraphModule, ins: tuple, outs: tuple, *, first: bool, device: torch.device
) -> tuple[nn.Module, tuple, tuple]:
    """The module ``PipelineStage`` runs and its tensor inputs and outputs (``ins``, ``outs``: a
    micro-batch's values, fake or empty). A stage past the first binds the inputs that are not
    tensors; a ``torch.device`` is bound as this rank's own, as in the one-process pipeline."""
    bound, sent = wiring(ins, outs, first=first, device=device)
    module = TensorsOnWire(program, bound, len(ins), sent)
    return module, tuple(v for i, v in enumerate(ins) if i not in bound), tuple(outs[i] for i in sent)


def wiring(ins: tuple, outs: tuple, *, first: bool, device: torch.device) -> tuple[dict[int, Any], tuple[int, ...]]:
    """``(bound, sent)`` of :class:`TensorsOnWire` for a micro-batch's ``ins`` and ``outs``."""
    bound = {} if first else {i: _here(v, device) for i, v in enumerate(ins) if not isinstance(v, torch.Tensor)}
    return bound, tuple(i for i, v in enumerate(outs) if isinstance(v, torch.Tensor))


def _here(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(_here(v, device) for v in value)
    return value


def batch_statistics_sites(program: fx.GraphModule, *, training: bool | None = None) -> list[str]:
    """The BatchNorm calls of ``program`` that normalise with the batch's statistics now (a
    module in training mode, or one without running statistics; ``F.batch_norm(training=True)``),
    or with ``training=True`` those that would in training mode."""
    sites = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is runtime.batch_norm:
            bn = _module_at(program, node.args[0])
            if bn is None or (bn.training if training is None else training) or bn.running_mean is None:
                sites.append(str(node.args[0].target if isinstance(node.args[0], fx.Node) else node.name))
        elif node.target is runtime.functional_batch_norm and _trains(program, node, training):
            sites.append(node.name)
    return sites


def _trains(program: fx.GraphModule, node: fx.Node, training: bool | None) -> bool:
    """Whether ``functional_batch_norm(chunks, ..., eps[, mode])`` normalises with the batch's statistics:
    always, or where it reads its module's mode at run time (``getattr(bn, "training")``), in that mode."""
    mode = node.args[7] if len(node.args) > 7 else True
    if not isinstance(mode, fx.Node) or training is not None:
        return mode is True or training is True
    bn = _module_at(program, mode.args[0]) if mode.target is getattr else None
    return bn is None or bn.training


def _module_at(program: fx.GraphModule, ref: Any) -> nn.Module | None:
    if isinstance(ref, fx.Node) and ref.op == "get_attr":
        try:
            return program.get_submodule(str(ref.target))
        except AttributeError:
            return None
    return None


def batch_norm_refusal(sites: list[str], micro_batches: int) -> DpCompileError:
    """Why BatchNorm with batch statistics cannot run on ``micro_batches`` > 1 over a mesh, and the ways out."""
    return DpCompileError(
        f"BatchNorm with batch statistics ({', '.join(sites)}) over a mesh with micro_batches={micro_batches}: its "
        "statistics are the whole batch's, which couples the micro-batches, while torch.distributed.pipelining's "
        "PipelineStage runs one micro-batch at a time, forward and backward, so each micro-batch would be normalised "
        "with its own statistics (and the running statistics updated once per micro-batch): exact whole-batch "
        "BatchNorm is impossible in this engine. Pass micro_batches=1 (one micro-batch: the whole batch), put the "
        "model in eval mode (running statistics: any micro_batches), or run the pipeline in one process "
        "(devices=[...]), where the micro-batches meet at BatchNorm"
    )


def batch_norm_dp_refusal(sites: list[str], dp_size: int) -> DpCompileError:
    """Why BatchNorm with batch statistics cannot run over a pipeline mesh's ``"dp"`` dimension."""
    return DpCompileError(
        f"BatchNorm with batch statistics ({', '.join(sites)}) over a pipeline mesh with a 'dp' dimension of "
        f"{dp_size}: each dp rank's pipeline would normalise with its own share of the batch (nothing synchronises "
        "the statistics over 'dp'), not with the global batch's as eager does, so the loss, the gradients and the "
        "running statistics would differ, silently. Put the model in eval mode (running statistics), use a "
        "('pp',) mesh with micro_batches=1, or data parallel alone over a ('dp',) mesh, where BatchNorm's "
        "statistics are synchronised"
    )


def split_into_steps(runs: list[tuple[int, int]], steps: int) -> list[tuple[int, int]] | None:
    """``runs`` (:func:`micro_batch_runs`) as ``steps`` schedule steps of the same micro-batches in the
    same order, a run of several micro-batches split in two; None where there are too few micro-batches.

    >>> split_into_steps([(2, 4)], 2), split_into_steps([(1, 4), (1, 3)], 2), split_into_steps([(1, 1)], 2)
    ([(1, 4), (1, 4)], [(1, 4), (1, 3)], None)
    """
    runs = list(runs)
    while len(runs) < steps:
        at = next((i for i, (count, _) in enumerate(runs) if count > 1), None)
        if at is None:
            return None
        count, rows = runs[at]
        runs[at : at + 1] = [(count - 1, rows), (1, rows)]
    return runs


class _BackwardDone(torch.autograd.Function):
    """The loss a pipeline step returns (one-process 1F1B, any schedule over a mesh): its backward
    has run inside the call. One plain ``loss.backward()`` (a gradient of 1, as after eager's
    forward) adds nothing more, so the usual
    training loop reads as it does for eager; anything that would need other gradients (a scaled
    loss, a second backward) raises instead of leaving ``.grad`` silently different."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, done: list) -> torch.Tensor:
        ctx.done = done
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        if not ctx.done and grad.numel() == 1 and bool(grad.eq(1).all()):
            ctx.done.append(True)
            return None, None
        again = "a second backward" if ctx.done else f"a backward with gradient {grad.flatten()[:4].tolist()}"
        raise DpCompileError(
            f"this pipeline ran the loss's backward inside the call (the schedule's step: each micro-batch's "
            f"backward between later micro-batches' forwards): the gradients are already in .grad, so {again} cannot be added to them. "
            "Call loss.backward() once (it adds nothing) or not at all, then optimizer.step(); for a loss you "
            "scale or combine yourself, use schedule='gpipe'"
        )


class _NoGradientPath(torch.autograd.Function):
    """An output beside the loss of a pipeline step that ran its backward: the values, with a
    backward that refuses."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise DpCompileError(
            f"a backward reached the output '{ctx.name}' of a pipeline that ran its loss's backward inside the call "
            "(schedule='1f1b' in one process, every schedule over a mesh: each micro-batch's backward between later "
            "micro-batches' forwards); this output has no gradient path, so a loss computed from it cannot reach the "
            "parameters and its gradient would be silently lost. Compute the whole loss in forward and return it "
            "(loss.backward() then adds nothing), or, in one process, use schedule='gpipe' to call backward on any "
            "function of the outputs"
        )


def no_gradient_path(value: Any, name: str) -> Any:
    """``value``'s floating tensors made to refuse any backward (they are detached: the step's own
    backward has run), so a gradient through them raises instead of being dropped."""
    flat, spec = tree_flatten(value)
    with torch.enable_grad():
        flat = [
            _NoGradientPath.apply(t.detach().requires_grad_(), name)
            if isinstance(t, torch.Tensor) and not t.requires_grad and (t.is_floating_point() or t.is_complex())
            else t
            for t in flat
        ]
    return tree_unflatten(flat, spec)


def backward_done(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, detached, whose one plain ``backward()`` adds nothing and any other raises."""
    with torch.enable_grad():
        return _BackwardDone.apply(loss.detach().requires_grad_(loss.is_floating_point()), [])


#: explain with inputs and measure of a pipeline over a mesh: the same refusal on every rank, before any collective
MESH_PIPELINE_INSPECTION = (
    "a pipeline over a DeviceMesh runs one stage per rank, fed by the stage before: explain(pm) without inputs "
    "reads this rank's stage program; to see a call's shapes, communication, memory and bubble, explain or "
    "measure the same pipeline in one process: dpcompile.transform(model, ['cpu'] * N, pipeline=N, ...)"
)

def materialized_copy(p: torch.Tensor, memo: dict[int, torch.Tensor], device: Any) -> torch.Tensor:
    """A stage's copy of a tied weight once a meta model's fake stage has memory (``memo``: ``{id(fake):
    real}``): the stage's real tensor, or real zeros where the stage does not read it (its gradient's share)."""
    if id(p) in memo:
        return memo[id(p)]
    return torch.zeros(p.shape, dtype=p.dtype, device=device) if is_fake(p) else p


__all__ = [
    "MESH_PIPELINE_INSPECTION",
    "TensorsOnWire",
    "backward_done",
    "batch_norm_dp_refusal",
    "batch_norm_refusal",
    "batch_statistics_sites",
    "materialized_copy",
    "micro_batch_runs",
    "split_into_steps",
    "no_gradient_path",
    "on_wire",
    "wiring",
    "writes",
]
