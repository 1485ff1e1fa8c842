"""One fake run of the model (``FakeTensorMode``: no memory, no compute) cut into units, what the
layout planner predicts every candidate from without building any of them.

The units are the model's repeated blocks (:func:`repeated_blocks`) and every module beside them on
the way down to them (GPT-2: ``transformer.wte``, ``transformer.wpe``, ``transformer.drop``, the
blocks ``transformer.h.0`` ..., ``transformer.ln_f``, ``lm_head``), in the order forward calls them;
a model without repeated blocks is cut at its top-level children. Per unit: the bytes of its
parameters (a tensor counted in the first unit that calls its module), of what autograd saves for
backward in it, of its input (what a checkpointed block keeps) and its forward FLOPs. Ops that run
between two units count with the one before (``"pre"``: before the first).

An op whose output size depends on the data (``nonzero``, ``masked_select``: DeBERTa-v2's loss)
returns its upper bound, every element of its input; any other op the fake run cannot run
(``.item()``, an op without a fake kernel) fails it with a :class:`ProfileError` that names the op.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dpcompile.analysis.attention_calls import attention_reads, record_attention
from dpcompile.analysis.backward_sweep import backward_moments, follow_saved, stamp_unit
from dpcompile.analysis.checkpoint_regions import repeated_blocks
from dpcompile.analysis.memory import faker, optimizer_bytes
from dpcompile.analysis.save_choice import SaveCandidate
from dpcompile.errors import DpCompileError, first_line
from dpcompile.runtime.kept import functional_call

__all__ = ["ModelProfile", "ProfileError", "ShardableWeight", "Unit", "profile_model", "unit_paths"]


class ProfileError(DpCompileError):
    """The planner's fake run of the model failed; the message names the op and the way out."""


@dataclass
class Unit:
    """A piece of the model, in the order forward runs it (see the module's docstring)."""

    name: str
    block: bool = False  # one of the repeated blocks: activation checkpointing recomputes it
    param_bytes: int = 0
    grad_bytes: int = 0
    module_grad_bytes: int = 0  # the largest gradient one of its modules' backward makes (its own parameters')
    optimizer_bytes: int = 0
    saved_bytes: int = 0
    largest_saved_bytes: int = 0  # the largest one tensor of saved_bytes (a backward's widest gradient)
    # of saved_bytes, those made between a Linear's output and the Linear that reads it back in a block
    # (tensor parallelism's column / row pair: each device makes and saves its shard of them)
    sharded_saved_bytes: int = 0
    # of those, by the (rows, cols) of the column layer whose pair made them (split by whole heads where the
    # layer projects to attention heads that do not divide: tensor parallelism's first device saves more)
    pair_saved_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    input_bytes: int = 0
    input_needs_grad: bool = True  # its input is made from parameters (or requires grad): backward makes its gradient
    flops: int = 0
    ops: int = 0  # aten ops its forward dispatches (what a step's fixed per-op cost multiplies)
    # its own module's forward dispatched an op (the captured graph has a node of it: a stage can start there)
    calls_ops: bool = True
    # a BatchNorm of it normalises by the batch's statistics: a pipeline's micro-batches meet there
    batch_norm: bool = False
    op_bytes: int = 0  # bytes those ops write (what memory-bound ops take time over)
    linear_inputs: int = 0  # distinct inputs its shardable layers read (q, k, v: one)
    shardable: list[ShardableWeight] = field(default_factory=list)
    # what the "auto" save rule may keep in it (a block), per row as the pass prices them
    save_options: list[SaveCandidate] = field(default_factory=list)
    rows: int = 0  # rows (tokens) of its first Linear's output over the whole batch
    row_bytes: int = 0  # bytes of one value per row over the whole batch
    # its scaled-dot-product attentions: their keys' and values' bytes (what context parallelism
    # gathers), their forward FLOPs, and whether every one is causal
    attention_kv_bytes: int = 0
    attention_flops: float = 0.0
    attention_causal: bool = True
    # its first attention's heads and their total width (tensor parallelism splits its projections by heads)
    attention_heads: int = 0
    attention_width: int = 0
    # the (rows, cols) of the column layers whose values its attentions read (q, k, v, fused or not; found
    # through the pair's values): those split by heads, and their row layers; empty: told by their shapes
    attention_columns: set[tuple[int, int]] = field(default_factory=set)
    # of saved_bytes, the masks its attentions read and save (each tensor-parallel device makes its own)
    attention_mask_bytes: int = 0
    # the moments of its backward, (value gradients held less its saved values freed, over the whole
    # batch; its parameters' gradients made): ``analysis.backward_sweep``; empty where not run
    backward_moments: list[tuple[int, int]] = field(default_factory=list)
    # the same where the program splits the batch over devices or micro-batches: a training BatchNorm runs
    # ``runtime.batch_norm``, whose backward holds two more values of its input's size in passing
    split_batch_moments: list[tuple[int, int]] = field(default_factory=list)
    # the gradient bytes its backward makes of parameters counted in other units (tied), by that unit
    tied_grad_bytes: dict[str, int] = field(default_factory=dict)
    tied_seen: set[int] = field(default_factory=set, repr=False)


@dataclass(frozen=True)
class ShardableWeight:
    """A Linear / Conv1D / Embedding weight tensor parallelism can split: its size along the split
    (out features, or the vocabulary), the bytes it and its bias hold (with gradients and optimizer
    state), and the elements of its output per step (what a row layer all-reduces)."""

    rows: int
    cols: int
    kind: str  # "linear" | "embedding"
    bytes: int
    grad_bytes: int
    optimizer_bytes: int
    output_elements: int


@dataclass
class ModelProfile:
    units: list[Unit]
    batch: int | None
    training: bool
    optimizer: str | None
    returns_loss: bool = False  # forward returns a scalar (its own loss): what a 1F1B schedule needs
    output_bytes: int = 0  # the floating tensors forward returns beside a scalar loss (a causal LM's logits)
    # of those, the ones no op saved for backward: what the caller's ``out`` alone holds through backward
    held_output_bytes: int = 0
    sequence: int | None = None  # the queries' length of the first attention (None: no attention found)
    # dim 1 of each block's row layer output, as tensor parallelism's program holds it (what sequence
    # parallelism reads as the sequence: an nn.MultiheadAttention's output projection's is its batch)
    row_lengths: tuple[int, ...] = ()

    @property
    def blocks(self) -> list[Unit]:
        return [u for u in self.units if u.block]

    def total(self, attribute: str) -> int:
        return sum(getattr(u, attribute) for u in self.units)


def _unit_modules(model: nn.Module, blocks: Sequence[str]) -> list[tuple[str, nn.Module, bool]]:
    """``(path, module, is a repeated block)`` of every unit (see the module's docstring)."""
    blocks = set(blocks)
    if not blocks:
        return list(_children_through_sequences(model))
    above = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    out: list[tuple[str, nn.Module, bool]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in above:
                walk(path, child)
            else:
                out.append((path, child, path in blocks))

    walk("", model)
    return out


def unit_paths(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The module path of every unit of ``model`` whose repeated blocks are ``blocks``."""
    return [path for path, _, _ in _unit_modules(model, blocks)]


def _children_through_sequences(module: nn.Module, prefix: str = "") -> Any:
    """``(path, module, False)`` of ``module``'s children, a ``Sequential`` among them replaced by its
    own (recursively): a model without repeated blocks cut where a pipeline can cut it (SqueezeNet's
    ``features.0`` ... ``features.12``, not ``features`` whole)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Sequential) and len(child) > 0:
            yield from _children_through_sequences(child, path)
        else:
            yield path, child, False


#: identical repeated blocks beyond this many are not run: they repeat the last one run
PROFILED_BLOCKS = 2


def profile_model(
    model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None, *, optimizer: str | None, training: bool
) -> ModelProfile:
    """The :class:`ModelProfile` of ``model(*args, **kwargs)`` (see the module's docstring).

    Where the repeated blocks are more than :data:`PROFILED_BLOCKS` modules of one type with
    parameters of the same shapes, only the first ones run (their container is shortened for the
    fake run, and put back) and the others repeat the last one run: planning a 32-layer decoder
    costs what a 2-layer one does. A model whose forward needs every block runs whole."""
    blocks = repeated_blocks(model)
    modules = dict(model.named_modules())
    container = modules.get(blocks[0].rpartition(".")[0]) if blocks else None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):  # blocks held as attributes: run them all
        container = None
    if len(blocks) > PROFILED_BLOCKS + 1 and container is not None and _identical(modules[b] for b in blocks):
        kept, skipped = blocks[:PROFILED_BLOCKS], blocks[PROFILED_BLOCKS:]
        whole = container._modules
        container._modules = type(whole)(list(whole.items())[:PROFILED_BLOCKS])
        try:
            profile = _profile(model, kept, args, kwargs, optimizer=optimizer, training=training)
        except Exception:  # noqa: BLE001 - forward needs every block (it indexes them): run it whole
            profile = None
        finally:
            container._modules = whole
        if profile is not None:
            names = [u.name for u in profile.units]
            last = profile.units[names.index(kept[-1])]
            copies = [dataclasses.replace(last, name=b, shardable=list(last.shardable)) for b in skipped]
            at = names.index(kept[-1]) + 1
            profile.units[at:at] = copies
            return profile
    return _profile(model, blocks, args, kwargs, optimizer=optimizer, training=training)


def _failed(model: nn.Module, op: Any, error: Exception) -> ProfileError:
    where = f" at {op}" if op is not None else ""
    return ProfileError(
        f"the planner sizes {type(model).__name__} from one run on fake tensors (shapes, no data), which failed"
        f"{where}: {type(error).__name__}: {first_line(error)[:300].rstrip('.')}. Name the layout yourself instead of "
        'plan="auto": leave plan= out (data parallel), or pass tensor_parallel=, pipeline= or mesh=; a '
        "data-dependent count read back (.item()) or an op without a fake kernel cannot be sized without data"
    )


def _identical(blocks: Any) -> bool:
    shapes = {(type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())) for m in blocks}
    return len(shapes) == 1


def _profile(
    model: nn.Module, blocks: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
    optimizer: str | None, training: bool,
) -> ModelProfile:  # fmt: skip
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = dict(kwargs or {})
    units_of = _unit_modules(model, blocks)
    unit_names = {id(m): path for path, m, _ in units_of}
    units = {"pre": Unit("pre")} | {path: Unit(path, block=block, calls_ops=False) for path, _, block in units_of}
    order: list[str] = ["pre"]
    state = {"current": "pre"}
    tensors = [t for t in [*model.parameters(), *model.buffers(), *args, *kwargs.values()] if isinstance(t, torch.Tensor)]
    mode = detect_fake_mode(tensors) or FakeTensorMode(allow_non_fake_inputs=True)
    target = next((t.device for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and not t.is_meta), None)

    fake = faker(mode, target)
    named = {name: fake(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    fake_args = [fake(a) for a in args]
    fake_kwargs = {k: fake(v) for k, v in kwargs.items()}
    excluded = {_key(v) for v in [*named.values(), *fake_args, *fake_kwargs.values()] if isinstance(v, torch.Tensor)}
    saved: dict[int, tuple[str, int, bool, tuple[int, int] | None]] = {}
    counted: dict[Any, str] = {}  # a parameter -> the unit it is counted in
    identity = {id(t): name for name, t in [*named.items(), *model.named_parameters(), *model.named_buffers()]}
    counter = FlopCounterMode(display=False)
    flops_at = {"start": 0, "ops": 0, "op_bytes": 0}

    def count_params(module: nn.Module, unit: str, recurse: bool, uses: bool = True) -> None:
        for p in module.parameters(recurse=recurse):
            ident = identity.get(id(p), id(p))  # the fake copy and the real tensor are one parameter
            size = p.numel() * p.element_size()
            if ident in counted:
                owner = counted[ident]  # a tied weight (GPT-2's lm_head): this unit's backward makes a gradient too
                if uses and owner != unit and training and p.requires_grad and id(p) not in units[unit].tied_seen:
                    units[unit].tied_seen.add(id(p))
                    units[unit].tied_grad_bytes[owner] = units[unit].tied_grad_bytes.get(owner, 0) + size
                continue
            counted[ident] = unit
            u = units[unit]
            u.param_bytes += size
            if training and p.requires_grad:
                u.grad_bytes += size
                u.optimizer_bytes += optimizer_bytes([p], optimizer)

    def enter(module: nn.Module, inputs: Any) -> None:
        name = unit_names[id(module)]
        stamp_unit(inputs, state["current"])  # what the units before made (their autograd nodes)
        _close(units[state["current"]], counter, flops_at)
        state["current"] = name
        order.append(name)
        between.clear()  # a pair ends with its block
        floating = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        units[name].input_bytes = sum(t.untyped_storage().nbytes() for t in floating)
        units[name].input_needs_grad = any(t.requires_grad for t in floating)
        count_params(module, name, True)

    def leave(module: nn.Module, inputs: Any, output: Any) -> None:
        units[state["current"]].calls_ops |= flops_at["ops"] > 0
        _close(units[state["current"]], counter, flops_at)  # what runs up to the next unit counts here too

    def called(module: nn.Module, inputs: Any) -> None:
        if id(module) not in unit_names:  # an nn.MultiheadAttention reads its out_proj's weight without calling it
            count_params(module, state["current"], isinstance(module, nn.MultiheadAttention))

    inputs_seen: set[tuple[str, int]] = set()

    def linear_enter(module: nn.Module, inputs: Any) -> None:
        inside_linear[0] += 1

    def linear_output(module: nn.Module, inputs: Any, output: Any) -> None:
        inside_linear[0] -= 1
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or id(weight) in shardable_seen:
            return
        shardable_seen.add(id(weight))
        kind = "embedding" if isinstance(module, nn.Embedding) else "linear"
        rows = weight.shape[1] if type(module).__name__ == "Conv1D" else weight.shape[0]  # transformers' Conv1D: (in, out)
        params = [p for p in (weight, getattr(module, "bias", None)) if isinstance(p, torch.Tensor)]
        size = sum(p.numel() * p.element_size() for p in params)
        out = sum(t.numel() for t in tree_leaves(output) if isinstance(t, torch.Tensor))
        _record_save_option(units[state["current"]], module, weight, rows, output, save_keys)
        read = next((_key(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
        if units[state["current"]].block and kind == "linear":
            if not any(_key(t) in between for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)):
                # a column layer: what its output makes is sharded up to the row layer
                mark_between(output, (int(rows), int(weight.numel() // rows)))
            elif isinstance(output, torch.Tensor) and output.dim() >= 3:
                row_lengths.append(int(output.shape[1]))
        if read is None or (state["current"], read) not in inputs_seen:
            inputs_seen.add((state["current"], read))
            units[state["current"]].linear_inputs += 1
        units[state["current"]].shardable.append(ShardableWeight(
            rows=int(rows), cols=int(weight.numel() // rows), kind=kind, bytes=size,
            grad_bytes=size if training and weight.requires_grad else 0,
            optimizer_bytes=optimizer_bytes(params, optimizer) if training else 0, output_elements=int(out),
        ))  # fmt: skip

    shardable_seen: set[int] = set()
    # storage -> a tensor of it made inside a block's column / row pair (held: no later storage takes its key),
    # and the (rows, cols) of the column layer that started the pair (None: an nn.MultiheadAttention's)
    between: dict[int, tuple[torch.Tensor, tuple[int, int] | None]] = {}

    def mark_between(out: Any, column: tuple[int, int] | None = None) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in attention_columns:
                between[_key(t)] = (t, column)

    def made(inputs: Any, out: Any) -> None:
        """An op outside Linear forwards reading a value of the pair makes one too; in a block, one
        reading an nn.MultiheadAttention's input projection starts a pair, its output projection ends it."""
        if inside_linear[0]:
            return
        read = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        if any(_key(t) in attention_rows for t in read):  # the weight or a view of it (its transpose)
            return
        starts = units[state["current"]].block and any(_key(t) in attention_columns for t in read)
        if starts or (between and any(_key(t) in between for t in read)):
            mark_between(out, next((between[_key(t)][1] for t in read if _key(t) in between), None))

    def attention_module(module: nn.Module, inputs: Any, output: Any) -> None:
        """An nn.MultiheadAttention's projections, which tensor parallelism splits by heads (it calls no
        Linear forward: ``F.multi_head_attention_forward`` reads the weights)."""
        tokens = next((t.numel() // t.shape[-1] for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), 0)
        unit = units[state["current"]]
        query = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
        if unit.block and query is not None and query.dim() == 3:  # decompose_attention's output projection: (T, B, E)
            row_lengths.append(int(query.shape[0 if module.batch_first else 1]))
        unit.linear_inputs += 1
        for weight, bias in ((module.in_proj_weight, module.in_proj_bias), (module.out_proj.weight, module.out_proj.bias)):
            if not isinstance(weight, torch.Tensor):  # separate q, k, v weights: not split
                return
            params = [p for p in (weight, bias) if isinstance(p, torch.Tensor)]
            size = sum(p.numel() * p.element_size() for p in params)
            unit.shardable.append(ShardableWeight(
                rows=int(weight.shape[0]), cols=int(weight.shape[1]), kind="linear", bytes=size,
                grad_bytes=size if training and weight.requires_grad else 0,
                optimizer_bytes=optimizer_bytes(params, optimizer) if training else 0,
                output_elements=int(tokens * weight.shape[0]),
            ))  # fmt: skip
    save_keys: dict[int, torch.Tensor] = {}  # id(save option) -> its output, held: no other storage takes its key

    def attention(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        query, value = args[0], args[2]
        unit = units[state["current"]]
        record_attention(unit, op, args, kwargs)
        column_of = lambda t: between.get(_key(t), (None, None))[1]  # noqa: E731 - a value's column layer
        masks.extend((state["current"], t) for t in attention_reads(unit, args, kwargs, column_of))
        sequence[0] = sequence[0] or int(query.shape[-2])
        width = value.shape[1] * value.shape[-1] if value.dim() == 4 else value.shape[-1]  # heads x head width
        unit.save_options.append(SaveCandidate(f"attention{len(unit.save_options)}", float(width), 0.0, True))
    sequence: list[int | None] = [None]
    masks: list[tuple[str, torch.Tensor]] = []  # (unit, an attention's mask), held: its storage keeps its key
    row_lengths: list[int] = []
    inside_linear = [0]  # Linear / Conv1D / Embedding forwards running
    handles = []
    for _, m, _ in units_of:
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    attention_columns: set[int] = set()  # the storages of nn.MultiheadAttention weights (fake)
    attention_rows: set[int] = set()
    for path, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention) and isinstance(m.in_proj_weight, torch.Tensor):
            attention_columns.add(_key(named[f"{path}.in_proj_weight" if path else "in_proj_weight"]))
            attention_rows.add(_key(named[f"{path}.out_proj.weight" if path else "out_proj.weight"]))
            handles.append(m.register_forward_hook(attention_module))
        if any(True for _ in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(called))
        if isinstance(m, (nn.Linear, nn.Embedding)) or type(m).__name__ == "Conv1D":
            handles += [m.register_forward_pre_hook(linear_enter), m.register_forward_hook(linear_output)]

    released: list[tuple[str | None, int, int]] = []  # saved values freed (in the fake backward)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in excluded and key not in saved:
            saved[key] = (state["current"], t.untyped_storage().nbytes(), key in between, between.get(key, (t, None))[1])
            follow_saved(t, state["current"], released)
        return t

    grad = torch.enable_grad() if training else torch.no_grad()
    ops = _OpCounter(flops_at, attention, made)
    try:
        with mode, grad, counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            out = functional_call(model, named, tuple(fake_args), fake_kwargs)
            _close(units[state["current"]], counter, flops_at)
            stamp_unit(out, state["current"])
    except DpCompileError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the model's own code on fake tensors
        raise _failed(model, ops.failed[-1] if ops.failed else None, e) from e
    finally:
        for h in handles:
            h.remove()
    count_params(model, "pre", True, uses=False)  # never called: counted with the first unit
    for path, module, _ in units_of if training else ():
        units[path].module_grad_bytes = max(_own_grad_bytes(m) for m in module.modules())
        units[path].batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules())
    for unit, size, sharded, column in saved.values():
        units[unit].saved_bytes += size
        units[unit].largest_saved_bytes = max(units[unit].largest_saved_bytes, size)
        units[unit].sharded_saved_bytes += size if sharded else 0
        if sharded and column is not None:
            units[unit].pair_saved_bytes[column] = units[unit].pair_saved_bytes.get(column, 0) + size
    for unit in units.values():
        _settle_save_options(unit, save_keys, saved)
    for name, size in {_key(t): (name, saved[_key(t)][1]) for name, t in masks
                       if saved.get(_key(t), (None,))[0] == name}.values():  # fmt: skip
        units[name].attention_mask_bytes += size
    if training:
        between.clear()
        save_keys.clear()  # held values: their storages would outlive backward
        _sweep_backward(mode, out, named.values(), released, units)
    ordered = list(dict.fromkeys(order)) + [n for n in units if n not in order]
    first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor) and a.dim()), None)
    return ModelProfile(
        units=[units[n] for n in ordered if n in units],
        batch=None if first is None else int(first.shape[0]),
        training=training,
        optimizer=optimizer,
        returns_loss=_returns_loss(out),
        output_bytes=_output_bytes(out),
        held_output_bytes=_output_bytes(out, saved) if training else 0,
        sequence=sequence[0],
        row_lengths=tuple(row_lengths),
    )


def _sweep_backward(mode: Any, out: Any, params: Any, released: list, units: dict[str, Unit]) -> None:
    """Each unit's ``backward_moments``, from a fake backward of the model's loss (its own, else the sum
    of its floating outputs); none where there is no loss or the fake backward fails."""
    try:
        with mode, torch.enable_grad():
            loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
            if not isinstance(loss, torch.Tensor):
                leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                loss = sum(t.float().sum() for t in leaves) if leaves else None
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return
            moments, split_batch = backward_moments(loss, params, released, units)
    except Exception:  # noqa: BLE001 - a backward the fake run cannot make: the sweep predicts without
        return
    for name, points in moments.items():
        units[name].backward_moments = points
        units[name].split_batch_moments = split_batch[name]


def _own_grad_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p.requires_grad)


def _close(unit: Unit, counter: Any, flops_at: dict[str, int]) -> None:
    total = counter.get_total_flops()
    unit.flops += total - flops_at["start"]
    flops_at["start"] = total
    unit.ops += flops_at["ops"]
    unit.op_bytes += flops_at["op_bytes"]
    flops_at["ops"] = flops_at["op_bytes"] = 0


def _record_save_option(unit: Unit, module: nn.Module, weight: torch.Tensor, rows: int, output: Any,
                        keys: dict[int, torch.Tensor]) -> None:  # fmt: skip
    """A Linear / Conv1D output in a block: what the ``"auto"`` rule may keep (``out`` values per row,
    ``2 * in * out`` FLOPs per row spared), as ``passes.checkpoint_budget`` prices it."""
    out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
    if not unit.block or isinstance(module, nn.Embedding) or out is None or not rows:
        return
    inner = weight.numel() // rows
    option = SaveCandidate(f"{type(module).__name__}{len(unit.save_options)}", float(rows), 2.0 * inner * rows, False)
    keys[id(option)] = out
    unit.save_options.append(option)
    if not unit.rows:
        unit.rows = out.numel() // rows
        unit.row_bytes = unit.rows * out.element_size()


def _settle_save_options(unit: Unit, keys: dict[int, torch.Tensor], saved: Mapping[int, Any]) -> None:
    """The block's last matmul is no option where backward does not read its output (a projection
    into the residual stream: the pass leaves it out); attention counts the region's median FLOPs."""
    matmuls = [o for o in unit.save_options if not o.attention]
    if matmuls and _key(keys[id(matmuls[-1])]) not in saved:
        unit.save_options.remove(matmuls[-1])
        matmuls.pop()
    median = statistics.median([o.flops for o in matmuls]) if matmuls else 1.0
    unit.save_options = [dataclasses.replace(o, flops=median) if o.attention else o for o in unit.save_options]


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched into ``counts["ops"]`` and the bytes of the tensors they return
    into ``counts["op_bytes"]`` (a view returns none of its own); calls ``attention(value)`` at each
    scaled-dot-product attention forward and ``made(inputs, outputs)`` after every op."""

    def __init__(self, counts: dict[str, int], attention: Any = None, made: Any = None) -> None:
        super().__init__()
        self.counts = counts
        self.attention = attention
        self.made = made
        self.failed: list[Any] = []  # the ops that raised, last the latest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts["ops"] += 1
        name = func.__name__
        if self.attention is not None and "scaled_dot_product" in name and "backward" not in name and len(args) > 2:
            self.attention(name.split(".")[0], args, kwargs or {})
        try:
            out = func(*args, **(kwargs or {}))
        except DynamicOutputShapeException:
            out = _upper_bound(func, args)
            if out is None:
                self.failed.append(func)
                raise
        except Exception:
            out = _grouped_mm_in_bfloat16(func, args, kwargs or {})
            if out is None:
                self.failed.append(func)
                raise
        if self.made is not None:
            self.made((args, kwargs), out)
        if not func.is_view:
            self.counts["op_bytes"] += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                           if isinstance(t, torch.Tensor))  # fmt: skip
        return out


def _upper_bound(func: Any, args: Sequence[Any]) -> torch.Tensor | None:
    """A data-dependent op's output at its largest: ``nonzero`` of every element, ``masked_select``
    keeping all (what the memory it may take is sized by); None for any other op."""
    aten = torch.ops.aten
    if func is aten.nonzero.default:
        return args[0].new_empty((args[0].numel(), args[0].dim()), dtype=torch.long)
    if func is aten.masked_select.default:
        return args[0].new_empty((torch.broadcast_shapes(args[0].shape, args[1].shape).numel(),))
    return None


def _grouped_mm_in_bfloat16(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """``_grouped_mm`` of float32 matrices (Mixtral's, Qwen2-MoE's experts), which CPU runs but whose fake
    kernel takes bfloat16 only: its output's shape from bfloat16 copies, in the inputs' dtype."""
    if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
        return None
    wide = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return func(*wide, **kwargs).to(args[0].dtype)


def _returns_loss(out: Any) -> bool:
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    leaves = [loss] if isinstance(loss, torch.Tensor) else tree_leaves(out)
    return any(isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() for t in leaves)


def _output_bytes(out: Any, saved: Mapping[int, Any] = {}) -> int:  # noqa: B006 - read only
    """The bytes of the floating tensors of ``out`` that are not scalars (a loss), and not among ``saved``
    (the storages saved for backward, counted there)."""
    leaves = tree_leaves(list(out.values()) if isinstance(out, Mapping) else out)
    storages = {_key(t): t.untyped_storage().nbytes() for t in leaves
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_floating_point() and _key(t) not in saved}  # fmt: skip
    return sum(storages.values())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def ceil_share(total: int, batch: int | None, parts: int) -> int:
    """The bytes of ``total`` (over a batch of ``batch``) that the largest of ``parts`` batch shares holds."""
    if not batch or parts <= 1:
        return total
    return total * math.ceil(batch / parts) // batch
