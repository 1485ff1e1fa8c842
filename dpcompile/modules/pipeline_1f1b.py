"""The 1F1B schedule in one process: forward and backward per stage and micro-batch, interleaved.

A training call of a ``schedule="1f1b"`` pipeline runs the step the way
``torch.distributed.pipelining.Schedule1F1B`` runs it on each rank: stage ``s`` runs
``min(M, S - s)`` warm-up forwards, then alternates one backward and one forward, then the
cool-down backwards, so it holds at most ``S - s`` micro-batches' activations. Here the stages
share one process, so :func:`one_f_one_b_order` merges the stages' orders by clock (what each
stage can run once the previous clock's work is done); on distinct GPUs the kernels are
asynchronous, so the stages overlap.

:class:`OneFOneBStep` runs a lowered pipeline program (micro-batches from ``scatter``, each node
stamped with its stage) as units: the nodes of one stage for one micro-batch. A value that
crosses to a later stage enters it detached (a leaf that requires grad), so each unit's
backward is its own ``torch.autograd.backward``, fed the gradients its later stages found::

    F(s, m):  outputs = unit(inputs_from_stage_s-1.detach().requires_grad_())
    B(s, m):  torch.autograd.backward(outputs, [grads the later stages' leaves received])

The last stage's backward seeds each micro-batch's loss *sum* scaled by the whole batch's
count (the sums and counts ``insert_scatter_gather`` writes a mean loss as), so every gradient
is the single-device one. What combines the micro-batches (the mean, the gathered outputs) runs
once at the end, without gradients: the call returns the outputs detached.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpcompile import runtime
from dpcompile.errors import DpCompileError
from dpcompile.fx_utils import STAGE, ancestors, state_access_order
from dpcompile.modules.mesh_stage import backward_done, no_gradient_path, writes
from dpcompile.runtime import exported

Unit = tuple[int, int]  # (stage, micro-batch)
_COMBINERS = (runtime.gather, runtime.mean_of_partials, runtime.reduce_add)
# an output class the model builds (a type), or its record in a loaded program (exported.model_output)
_TAIL_OPS = (*_COMBINERS, runtime.send, operator.getitem, operator.truediv, torch.div, torch.ops.aten.div.Tensor,
             exported.model_output)  # fmt: skip


def one_f_one_b_order(stages: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """Every stage's 1F1B actions ``("F" | "B", stage, micro_batch)``, merged by clock: at each
    clock every stage runs its next action if what it waits for ran at an earlier clock.

    >>> one_f_one_b_order(2, 2)
    [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('B', 1, 0), ('B', 0, 0), ('F', 1, 1), ('B', 1, 1), ('B', 0, 1)]
    """
    queues = []
    for s in range(stages):
        warmup = min(micro_batches, stages - s)
        actions = [("F", m) for m in range(warmup)]
        for b in range(micro_batches):
            actions.append(("B", b))
            if warmup + b < micro_batches:
                actions.append(("F", warmup + b))
        queues.append(actions)
    done: set[tuple[str, int, int]] = set()
    order: list[tuple[str, int, int]] = []
    position = [0] * stages
    while len(order) < 2 * stages * micro_batches:
        clock = []
        for s, actions in enumerate(queues):
            if position[s] == len(actions):
                continue
            kind, m = actions[position[s]]
            if kind == "F":
                ready = s == 0 or ("F", s - 1, m) in done
            else:
                ready = ("F", s, m) in done and (s == stages - 1 or ("B", s + 1, m) in done)
            if ready:
                clock.append((kind, s, m))
        if not clock:  # cannot happen for 1F1B; a guard against an endless loop
            raise RuntimeError(f"1F1B order stalls after {order}")
        for action in clock:
            done.add(action)
            position[action[1]] += 1
        order.extend(clock)
    return order


class OneFOneBStep:
    """A lowered pipeline program run as 1F1B units (see the module docstring).

    ``program``: the pipeline program (``insert_scatter_gather`` over the micro-batches, then
    ``insert_stage_transfers``), each node stamped with its stage (``node.meta[STAGE]``; sends to
    the output have none).
    Refuses, with the reason, a program whose micro-batches meet before the loss (BatchNorm in
    training, an op run on the gathered batch) or that returns no mean loss."""

    def __init__(self, program: fx.GraphModule, stages: int, micro_batches: int):
        self.program, self.stages, self.micro_batches = program, stages, micro_batches
        nodes = [n for n in program.graph.nodes if n.op != "output"]
        stage_of = {n: n.meta[STAGE] for n in nodes if STAGE in n.meta}
        self.output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
        stateful: set[fx.Node] = set()  # reads a module or a parameter: not a function of the inputs alone
        tail: set[fx.Node] = set()  # combines the micro-batches into the outputs: runs once, at the end
        for n in nodes:
            if n.op in ("call_module", "get_attr") or any(a in stateful for a in n.all_input_nodes):
                stateful.add(n)
            combines = n.op == "call_function" and n.target in _COMBINERS
            if combines or any(a in tail for a in n.all_input_nodes) or (n.op != "placeholder" and n not in stage_of):
                tail.add(n)
        micro = _micro_batches_read(nodes, stateful)
        self.units: dict[Unit, list[fx.Node]] = {}
        self.unit_of: dict[fx.Node, Unit] = {}
        self.head: list[fx.Node] = []  # functions of the inputs alone (masks, positions, counts): run first
        self.shared: set[fx.Node] = set()  # read parameters, no micro-batch: run again in each unit that reads them
        self.tail = [n for n in nodes if n in tail]
        self.once: set[fx.Node] = set()  # writes no micro-batch reads (a step counter): once a call, in order
        for n in nodes:
            if n in tail:
                continue
            if n not in stateful:
                if n.op != "placeholder":
                    self.head.append(n)
            elif len(micro[n]) > 1:
                raise _coupled_error(n, micro_batches)
            elif micro[n]:
                unit = (stage_of[n], next(iter(micro[n])))
                self.units.setdefault(unit, []).append(n)
                self.unit_of[n] = unit
            elif has_effect(n):  # in micro-batch 0's forward of its stage, where program order puts it
                self.units.setdefault((stage_of[n], 0), []).append(n)
                self.once.add(n)
            else:
                self.shared.add(n)
        for n, earlier in state_access_order(nodes).items():  # reads the state a write of the whole batch made
            met = next((e for e in earlier if e in tail), None)
            if met is not None and n not in tail:
                raise _coupled_error(met, micro_batches)
        returned = ancestors(self.output)
        for n in self.tail:  # what reaches no output (an EMA of the loss) runs once, at the end, detached
            tail_op = n.op == "call_function" and (n.target in _TAIL_OPS or isinstance(n.target, type))
            if n in returned and not tail_op:
                raise _coupled_error(n, micro_batches)
        for n, unit in self.unit_of.items():
            for a in n.all_input_nodes:
                if a in self.unit_of and self.unit_of[a][0] > unit[0]:
                    raise DpCompileError(
                        f"'{n.name}' (stage {unit[0]}) reads '{a.name}' of a later stage; 1F1B cannot order it"
                    )
        self.loss, self.sums, self.counts = _find_mean_loss([n for n in self.tail if n in returned], self.output)
        if self.loss is None:
            raise DpCompileError(
                "schedule='1f1b' runs each micro-batch's backward inside a training call, from the model's own mean "
                "loss, but this model returns none (outputs: "
                f"{', '.join(n.name for n in self.output.all_input_nodes)}). Return the mean loss from forward "
                "(e.g. F.cross_entropy(logits, labels), transformers' labels=), or use schedule='gpipe' and call "
                "backward on a loss of the outputs yourself; under torch.no_grad() or in eval mode 1f1b runs forward only"
            )
        # counts that follow from the inputs alone (non-ignored labels) are known before any backward
        self.counts_known = not any(c in stateful for c in self.counts if isinstance(c, fx.Node))
        self.readers = {n: {self.unit_of[u] if u in self.unit_of else None for u in n.users} for n in self.unit_of}
        self.dead_after = {unit: _dead_after(unit_nodes) for unit, unit_nodes in self.units.items()}
        self.tail_dead_after = _tail_dead_after(self.tail, self.output)
        self.runner = _Runner(program)
        # a shared module holding buffers (spectral_norm's power iteration vectors) runs again from the
        # buffers its first run of the call read: eager computes it once a call, so updates them once
        self.shared_buffers = {n: list(self.runner.modules[n.target].buffers()) for n in self.shared
                               if n.op == "call_module" and any(True for _ in self.runner.modules[n.target].buffers())}
        self.run_backward = torch.autograd.backward  # dpcompile.measure runs it counting each device's bytes
        # dpcompile.measure's zeros in place of no gradient (dp copies on virtual devices share one set): not
        # cloned to divide the step's share after it, as a step after zero_grad() clones nothing
        self.gradients_preset_to_zero = False

    # ------------------------------------------------------------------ the step
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        runner = self.runner
        inputs = _bind(self.program, args, kwargs)
        values: dict[fx.Node, Any] = dict(zip(_placeholders(self.program), inputs))
        runner.env = values
        for n in self.head:
            values[n] = runner.run_node(n)
        scale, divide_after = 1.0, None
        if self.counts_known:
            scale = 1.0 / _total(self.counts, values)
        else:  # the count is found with the activations: divide this step's gradients after it
            leaves = _gradient_leaves(self.program, inputs)
            fresh = self.gradients_preset_to_zero
            divide_after = {t: None if t.grad is None or fresh else t.grad.clone() for t in leaves}
        state = _StepState(self, runner, values, scale)
        for kind, s, m in one_f_one_b_order(self.stages, self.micro_batches):
            (state.forward if kind == "F" else state.backward)((s, m))
        if divide_after is not None:
            _divide_step_gradients(divide_after, _total(self.counts, state.kept))
        return state.finish()


class _StepState:
    """One call's values: what each unit keeps for later units, for the tail and for backward."""

    def __init__(self, step: OneFOneBStep, runner: _Runner, values: dict, scale: float):
        self.step, self.runner, self.values, self.scale = step, runner, values, scale
        self.sent: dict[Unit, dict[fx.Node, tuple]] = {}  # unit -> node -> (flat leaves, spec) later units read
        self.leaves: dict[Unit, list[tuple[fx.Node, int, torch.Tensor]]] = {}  # boundary leaves a unit made
        self.grads: dict[tuple[fx.Node, int], torch.Tensor] = {}
        self.losses: dict[Unit, torch.Tensor] = {}
        self.kept: dict[fx.Node, Any] = {}  # detached values the tail reads
        self.buffers_before: dict[fx.Node, list[torch.Tensor]] = {}  # a shared module's buffers at its first run

    def run_shared(self, node: fx.Node) -> Any:
        """Run a shared node (a parameter's function) again for a unit: a module's buffers its first run
        in this call wrote are put back first, so each run computes the first's value and the call leaves
        them written once (spectral_norm: one power iteration a step, as eager, not one a micro-batch)."""
        buffers = self.step.shared_buffers.get(node, ())
        before = self.buffers_before.get(node)
        if before is None:
            self.buffers_before[node] = [b.clone() for b in buffers]
        else:
            with torch.no_grad():
                for buffer, value in zip(buffers, before, strict=True):
                    if not torch.equal(buffer, value):  # a buffer no run writes keeps its version
                        buffer.copy_(value)
        return self.runner.run_node(node)

    def forward(self, unit: Unit) -> None:
        """Run ``unit``'s nodes; each value goes at its last read in the unit (as ``fx.Interpreter``
        drops it), unless a later unit, the tail or the loss reads it: a micro-batch in flight holds
        what autograd saved, not every value its forward made (measured: 1.5x on Llama's stage)."""
        step = self.step
        env = _UnitEnv(self, unit)
        self.runner.env = env
        self.leaves[unit] = []
        sent: dict[fx.Node, tuple] = {}
        nodes = step.units.get(unit, ())
        for n, done in zip(nodes, step.dead_after.get(unit, ()), strict=True):
            env[n] = value = self.runner.run_node(n)
            if n in step.once:  # every unit and the tail read the one value
                self.values[n] = value
            else:
                readers = step.readers[n]
                if any(r is not None and r != unit for r in readers):
                    sent[n] = tree_flatten(value)
                if None in readers or n in step.counts:
                    self.kept[n] = _detached(value)
                if n in step.sums:
                    self.losses[unit] = value
            for u in n.users:  # x_mb0.shape, read in later stages and micro-batches: kept, not x_mb0
                if u in step.shared and _reads_metadata(u):
                    self.values[u] = self.runner.run_node(u)
            for dead in done:
                env.pop(dead, None)
            del value
        self.sent[unit] = sent
        self.runner.env = self.values  # the unit's other values go: autograd holds what its backward needs

    def backward(self, unit: Unit) -> None:
        tensors, grads = [], []
        for n, (flat, _) in self.sent.pop(unit, {}).items():
            for i, t in enumerate(flat):
                g = self.grads.pop((n, i), None)
                if g is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
        loss = self.losses.pop(unit, None)
        if loss is not None and loss.requires_grad:
            tensors.append(loss * self.scale)
            grads.append(None)
        if tensors:
            self.step.run_backward(tensors, grads)
        for n, i, leaf in self.leaves.pop(unit, ()):
            if leaf.grad is not None:
                key = (n, i)
                self.grads[key] = leaf.grad if key not in self.grads else self.grads[key] + leaf.grad

    def finish(self) -> Any:
        env = _TailEnv(self)
        self.runner.env = env
        guarded = {self.step.loss}  # the loss, and the loss sent to the output device (not the last stage's)
        holding = set()  # what holds the loss itself (a ModelOutput built around it): a send of it guards the copy
        # only the loss is attached to a graph (the guard below): the rest is detached; what no later
        # tail node nor the output reads goes (each micro-batch's logits once gathered: measured, the last
        # stage held them beside the gathered logits and the outputs' copies, 3x the logits at the end)
        for i, n in enumerate(self.step.tail):
            with torch.no_grad():
                env[n] = self.runner.run_node(n)
            if n is self.step.loss or (n.target is runtime.send and n.args[0] in guarded):
                env[n] = backward_done(env[n])
                guarded.add(n)
            elif n.target is runtime.send and n.args[0] in holding:
                env[n] = _loss_copies_guarded(env[n.args[0]], env[n])
            elif any(a in guarded or a in holding for a in n.all_input_nodes):
                holding.add(n)
            for dead in self.step.tail_dead_after[i]:
                env.pop(dead, None)
                self.kept.pop(dead, None)

        def returned(n: fx.Node) -> Any:  # the loss is guarded above; inputs returned as they are keep their graph
            if n in guarded or n.op == "placeholder" or not torch.is_grad_enabled():
                return env[n]
            return no_gradient_path(env[n], n.meta.get("dpcompile_name", n.name))

        return _plain(fx.node.map_arg(self.step.output.args[0], returned))


def _loss_copies_guarded(sent: Any, arrived: Any) -> Any:
    """``arrived`` (``sent`` copied to the output device under ``no_grad``) with the copy of each
    tensor that is the guarded loss guarded again: its one plain ``backward()`` adds nothing."""
    flat, spec = tree_flatten(arrived)
    flat = [backward_done(t) if isinstance(s, torch.Tensor) and s.requires_grad else t
            for s, t in zip(tree_flatten(sent)[0], flat)]  # fmt: skip
    return tree_unflatten(flat, spec)


class _Runner:
    """Runs one node at a time in ``env``, which finds what a unit reads where it lives
    (``__missing__``): fx's ``Interpreter`` without its per-node bookkeeping."""

    def __init__(self, program: fx.GraphModule):
        self.program = program
        self.modules = dict(program.named_modules())
        self.env: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        load = self.env.__getitem__
        args, kwargs = fx.node.map_arg(n.args, load), fx.node.map_arg(n.kwargs, load)
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_module":
            return self.modules[n.target](*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "get_attr":
            return functools.reduce(getattr, str(n.target).split("."), self.program)
        raise ValueError(f"cannot run {n.op} '{n.name}' alone")


class _UnitEnv(dict):
    """A unit's values: its own, the inputs' (``head``), parameters' reads run again, and values
    of earlier stages, which arrive detached (leaves, so this unit's backward stops there)."""

    def __init__(self, state: _StepState, unit: Unit):
        super().__init__()
        self.state, self.unit = state, unit

    def __missing__(self, node: fx.Node) -> Any:
        state, step = self.state, self.state.step
        if node in state.values:
            return state.values[node]
        if node in step.shared:
            self[node] = value = state.run_shared(node)  # its own inputs resolve here too
            return value
        source = step.unit_of.get(node)
        if source is None or source == self.unit:
            raise KeyError(node.name)
        flat, spec = state.sent[source][node]
        leaves = []
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t = t.detach().requires_grad_()
                state.leaves[self.unit].append((node, i, t))
            leaves.append(t)
        self[node] = value = tree_unflatten(leaves, spec)
        return value


class _TailEnv(dict):
    def __init__(self, state: _StepState):
        super().__init__()
        self.state = state

    def __missing__(self, node: fx.Node) -> Any:
        state = self.state
        if node in state.kept:
            return state.kept[node]
        if node in state.values:
            return state.values[node]
        if node in state.step.shared:
            with torch.no_grad():
                self[node] = value = state.run_shared(node)
            return value
        raise KeyError(node.name)


def _dead_after(nodes: list[fx.Node]) -> list[tuple[fx.Node, ...]]:
    """Per node of a unit (in order), the unit's nodes nothing later in the unit reads once it has run
    (their last reader, or themselves where no node of the unit reads them)."""
    position = {n: i for i, n in enumerate(nodes)}
    last = {n: i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if a in position:
                last[a] = max(last[a], i)
    dead: list[list[fx.Node]] = [[] for _ in nodes]
    for n, i in last.items():
        dead[i].append(n)
    return [tuple(d) for d in dead]


def _tail_dead_after(tail: list[fx.Node], output: fx.Node) -> list[tuple[fx.Node, ...]]:
    """Per tail node (in order), the values it reads that no later tail node and not the output read."""
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(tail):
        for a in n.all_input_nodes:
            last[a] = i
    returned = set(output.all_input_nodes)
    dead: list[list[fx.Node]] = [[] for _ in tail]
    for a, i in last.items():
        if a not in returned:
            dead[i].append(a)
    return [tuple(d) for d in dead]


def _micro_batches_read(nodes: list[fx.Node], stateful: set[fx.Node]) -> dict[fx.Node, frozenset[int]]:
    """The micro-batches each node's value depends on (``scatter(x, ...)[m]`` starts micro-batch
    ``m``). A device, dtype or size read from a micro-batch carries none of its values
    (``arange(T, device=x_mb0.device)`` serves every micro-batch), and a function of the inputs
    alone that reads several (``batch_arange(sizes, k)``) runs before the schedule: neither ties
    what reads it to a micro-batch."""
    micro: dict[fx.Node, frozenset[int]] = {}
    for n in nodes:
        source = n.args[0] if n.op == "call_function" and n.target is operator.getitem else None
        if isinstance(source, fx.Node) and source.op == "call_function" and source.target is runtime.scatter:
            micro[n] = frozenset({n.args[1]})
        elif _reads_metadata(n):
            micro[n] = frozenset()
        else:
            reads = (micro[a] for a in n.all_input_nodes if a in stateful or len(micro[a]) <= 1)
            micro[n] = frozenset().union(*reads)
    return micro


def has_effect(n: fx.Node) -> bool:
    """Whether ``n`` writes into a tensor (:func:`~dpcompile.modules.mesh_stage.writes`) or is otherwise
    impure: eager runs it once per call, whoever reads it."""
    return writes(n) or (n.op in ("call_function", "call_module") and n.is_impure())


def _reads_metadata(n: fx.Node) -> bool:
    """``x.device``, ``x.dtype``, ``x.shape``, ``x.size(0)``, ``x.dim()``: what a tensor is, not what it holds."""
    if n.op == "call_function" and n.target is getattr:
        return n.args[1] in ("device", "dtype", "shape", "ndim", "is_cuda")
    if n.op == "call_method":
        return n.target in ("size", "dim")
    return n.op == "call_function" and n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)


def _find_mean_loss(tail: list[fx.Node], output: fx.Node) -> tuple[fx.Node | None, list, list]:
    """The loss the step backwards: ``mean_of_partials(sums, counts)`` or ``reduce_add(sums) /
    reduce_add(counts)`` (a mean cross-entropy as the export frontend writes it). None: no loss."""
    found = []
    for n in tail:
        if n.target is runtime.mean_of_partials:
            found.append((n, list(n.args[0]), list(n.args[1])))
        elif n.target in (operator.truediv, torch.div, torch.ops.aten.div.Tensor) and all(
            isinstance(a, fx.Node) and a.target is runtime.reduce_add for a in n.args[:2]
        ):
            found.append((n, list(n.args[0].args[0]), list(n.args[1].args[0])))
    if len(found) > 1:
        raise DpCompileError(
            f"schedule='1f1b' backwards the model's mean loss inside the call, but the outputs hold "
            f"{len(found)} mean losses ({', '.join(f[0].name for f in found)}); return one loss (their sum), or "
            "use schedule='gpipe' and call backward yourself"
        )
    if not found:
        return None, [], []
    return found[0]


def _coupled_error(node: fx.Node, micro_batches: int) -> DpCompileError:
    """Why 1F1B cannot run a program whose micro-batches meet at ``node`` before the loss."""
    waits = (
        f"1F1B runs micro-batch 0's backward before micro-batch {micro_batches - 1}'s forward, so every micro-batch "
        f"must reach the loss on its own; the {micro_batches} micro-batches meet at '{node.name}'"
    )
    if node.op == "call_function" and node.target is runtime.batch_norm:
        module = node.args[0].target if isinstance(node.args[0], fx.Node) else node.args[0]
        return DpCompileError(
            f"{waits}: BatchNorm '{module}' in training normalises with the whole batch's statistics, which need "
            "every micro-batch's forward before any backward. Use schedule='gpipe' (the same values and gradients), "
            "micro_batches=1, or put the model in eval mode (pm.eval()) for 1f1b"
        )
    target = getattr(node.target, "__name__", node.target)
    if writes(node) or node.target is runtime.in_place_without_grad:
        where = (node.meta.get("stack_trace") or "").strip().split("\n")[0]
        return DpCompileError(
            f"{waits}: forward writes the model's state in place from the whole batch ({node.name}{f', {where}' if where else ''}: "
            "an EMA of an activation's mean) and later code reads it, so no micro-batch can go on before every "
            "micro-batch's forward. Use schedule='gpipe' (the same values and gradients), micro_batches=1, or read the "
            "state before the write"
        )
    return DpCompileError(
        f"{waits} ({node.op} {target}: an op without a batch rule runs on the gathered batch, or an output that is "
        "neither split along the batch nor a mean loss). Use schedule='gpipe', or micro_batches=1"
    )


def _total(counts: list, values: Mapping[fx.Node, Any]) -> float:
    """The whole batch's count: the micro-batches' counts added up."""
    return sum(float(values[c]) if isinstance(c, fx.Node) else float(c) for c in counts)


def _gradient_leaves(program: fx.GraphModule, inputs: list) -> list[torch.Tensor]:
    """What a step's backward adds gradients to: the parameters, and inputs that require grad
    (leaves: a gradient that flows on into the caller's graph cannot be divided after the step)."""
    leaves = list(program.parameters())
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if not t.is_leaf:
                raise DpCompileError(
                    "schedule='1f1b' divides this step's gradients by the loss's count after the step (the mean is "
                    "over activations, so the count is known only after the forwards), but an input requires grad "
                    "and is not a leaf: its gradient would flow on undivided. Pass it detached "
                    "(x.detach().requires_grad_()), or use schedule='gpipe'"
                )
            leaves.append(t)
    return leaves


def _divide_step_gradients(before: Mapping[torch.Tensor, torch.Tensor | None], total: float) -> None:
    """The step back-propagated loss sums: divide what it added to each gradient by the count,
    keeping what was accumulated before the call."""
    for t, old in before.items():
        if t.grad is None:
            continue
        if old is None:
            t.grad.div_(total)
        else:
            t.grad.copy_(old + (t.grad - old) / total)


def _detached(value: Any) -> Any:
    flat, spec = tree_flatten(value)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _plain(value: Any) -> Any:
    """``value`` with fx's immutable lists and dicts (what ``map_arg`` builds around the output's nodes)
    as the plain ones forward returned; a value a node computed (a ``ModelOutput``, a user's dict) is kept."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if type(value) is immutable_dict:
        return {k: _plain(v) for k, v in value.items()}
    if type(value) is immutable_list:
        return [_plain(v) for v in value]
    if type(value) is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
        parts = [_plain(v) for v in value]
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
    return value


def _placeholders(program: fx.GraphModule) -> list[fx.Node]:
    return [n for n in program.graph.nodes if n.op == "placeholder"]


def _bind(program: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The call's arguments in the program's placeholder order (defaults where left out)."""
    bound = inspect.signature(program.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())
