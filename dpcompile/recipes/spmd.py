"""SPMD: ``transform(model, mesh)`` with a ``torch.distributed`` ``DeviceMesh``.

One process per device, launched with ``torchrun``; every process runs ``transform`` on the
same model and gets the program of its own rank:

* **1-D mesh, data parallel** (``tensor_parallel=False``): each process feeds its own part
  of the batch. The program is the captured model (the ``flatten_parameters`` hoist applied)
  with every BatchNorm lowered to :func:`~dpcompile.runtime.distributed.sync_batch_norm`
  over the mesh, run under ``DistributedDataParallel``, which averages the gradients across
  processes. ``pm`` shares the model's parameters, as the single-process mode does.
* **1-D mesh, tensor parallel** (``tensor_parallel=True`` or a plan): ``shard_linear``'s
  one-shard program with its collectives lowered to process-group collectives by
  ``passes.collectives.lower_to_collectives``. Each rank holds only its shards; every
  process feeds the same input and gets the full output.
* **2-D mesh ("dp", "tp")**: tensor parallel within each ``tp`` group, data parallel (DDP
  over the ``dp`` groups) across them — the torchtitan layout.
* **1-D mesh ("cp",)**: context parallel's one-process program over ``N`` virtual devices,
  cut to this rank (``passes.lower_sequence_to_rank``): each rank feeds its part of the
  sequence, attention all-gathers keys and values over ``cp``, DDP gives the summed gradients.
* **2-D mesh ("dp", "cp")**: that cp rank program on each dp rank's rows, DDP over every rank
  (``dp`` x ``cp`` flattened): the cp sums averaged over ``dp``; a mean over every token (the loss)
  is the whole batch's, its sum and count reduced over every rank.
* **2-D mesh ("cp", "tp")**: the tensor-parallel rank program on this cp rank's part of the sequence,
  attention's keys and values all-gathered over ``cp``, DDP over ``cp`` on each tp rank's shards.

>>> # torchrun --nproc-per-node 2 train.py                                # doctest: +SKIP
>>> dist.init_process_group("gloo")                                       # doctest: +SKIP
>>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))          # doctest: +SKIP
>>> pm = dpcompile.transform(model, mesh)                                 # doctest: +SKIP
>>> loss = pm(x_local).mean(); loss.backward()   # gradients averaged     # doctest: +SKIP

A call that departs from the first one (the other mode, an argument left None, a flag value)
runs this rank's program traced for it, as in one process: on the model itself (data
parallel) or on a fake-tensor copy with ``pm``'s plan (tensor parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import passes
from dpcompile.analysis.batch_dims import infer_input_dims
from dpcompile.analysis.random_ops import random_kind
from dpcompile.analysis.sharding import linear_like_leaves
from dpcompile.capture import EXPORTED_FROM, capture
from dpcompile.devices import Devices
from dpcompile.errors import ArgumentError, DpCompileError
from dpcompile.fake import fake_copy, fake_copy_to_trace, is_fake, meta_copy_to_pickle
from dpcompile.fx_utils import bind_inputs, copy_graph, graph_module, propagate_shapes, unalias
from dpcompile.infra import info_of, run_passes
from dpcompile.mesh import check_fsdp_parameters, check_mesh, mesh_size
from dpcompile.modules.base import ParallelModule
from dpcompile.modules.carried import modes_applied
from dpcompile.modules.mesh_exported_inputs import hold_exported_inputs
from dpcompile.modules.other_mode import agreed_over_mesh, swap_graph
from dpcompile.modules.spmd import hold_mesh, repeated_blocks
from dpcompile.modules.tensor_parallel import watch_source_parameters
from dpcompile.planning import plan_for
from dpcompile.program_cache import CallKey
from dpcompile.recipes.base import Recipe, capture_with_flags, move_to
from dpcompile.recipes.constants import RealConstants, deepcopy_on_fake
from dpcompile.recipes.data_parallel import without_sequence_replicated
from dpcompile.recipes.tensor_parallel import aliased_plan, share_tied_shard, tied_groups, unaliased_findings
from dpcompile.runtime.distributed import collective_failure
from dpcompile.runtime.tensor_parallel import shard_of
from passes.stage_shards import borrow_shapes


@dataclass(frozen=True)
class SpmdRecipe(Recipe):
    """This rank's program over ``mesh``; ``plan``: False (data parallel), True or ``{path: style}``.

    ``ddp_options`` are passed to ``DistributedDataParallel`` (``bucket_cap_mb=``, ...).
    ``data_parallel``: ``"ddp"`` or ``"fsdp"`` (FSDP2's ``fully_shard`` per repeated block, then
    the root; ``mixed_precision``: its ``MixedPrecisionPolicy``).
    """

    mesh: Any = field(default=None, compare=False)
    plan: bool | Mapping[str, str] = False
    ddp_options: Mapping[str, Any] = field(default_factory=dict)
    data_parallel: str = "ddp"
    mixed_precision: Any = field(default=None, compare=False)
    fsdp_blocks: tuple[type[nn.Module], ...] = ()  # the block classes FSDP wraps, called whole by the program
    sequence_parallel: bool = False  # activations between the tp pairs on sequence shards (passes.shard_sequence)

    @property
    def mode(self) -> str:
        return check_mesh(self.mesh, self.plan)[0]

    @property
    def replicates_model(self) -> bool:  # data parallel over the mesh
        return self.plan is False

    @property
    def strategy(self) -> str:  # type: ignore[override]
        return "data_parallel" if self.plan is False else "tensor_parallel"

    @property
    def splits_batch(self) -> bool:  # type: ignore[override]
        return "cp" in (self.mesh.mesh_dim_names or ())  # cp's one-process program cut to this rank

    def compile(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> ParallelModule:
        """Every rank must call it: it is collective (DDP and the tensor-parallel model broadcast
        the first rank's parameters and buffers)."""
        exported = isinstance(model, fx.GraphModule) and EXPORTED_FROM in model.meta  # the export frontend's program
        on_meta = meta_copy_to_pickle(model) if self.data_parallel == "fsdp" or exported else None  # before FSDP2
        pm = self._compile_rank(model, example_inputs)  # swaps its classes (and tp shards the program's modules)
        pm.__dict__["example_specs"] = example_specs(example_inputs)  # what export over a mesh records
        hold_exported_inputs(pm, model.meta.get(EXPORTED_FROM) if exported else None)  # checked at each call
        if on_meta is not None and (exported or pm.__dict__.get("traced_model") is not None):  # what export over a
            pm.__dict__["model_on_meta"] = on_meta  # mesh copies: the model, or the program export captured
        return pm

    @property
    def completes_other_mode(self) -> bool:  # type: ignore[override]
        """Data and context parallel over DDP: the lowering passes again, no collective (FSDP2 swaps the
        model's classes, which export would read; tensor parallel exports twice still)."""
        return self.data_parallel != "fsdp" and self.mode in ("spmd_data_parallel", "spmd_context_parallel")

    def complete_other_mode(self, pm: ParallelModule, merged: fx.GraphModule, examples: Sequence[Any] | None) -> Any:
        """This rank's program lowered again from ``merged`` (over the model's own modules, which ``pm``
        holds), as :meth:`compile` lowered the capture; every rank of the mesh agrees it was built."""
        recipe, device = pm.recipe, pm.devices.primary

        def lowered() -> fx.Graph:
            gm = capture(merged)
            if pm.mode == "spmd_context_parallel":
                gm, _ = recipe._lower_context_parallel(gm, device, list(examples or ()))
            else:
                if examples is not None:
                    propagate_shapes(gm, [x.to(device) if isinstance(x, torch.Tensor) else x for x in examples])
                gm, _ = run_passes(gm, recipe._data_parallel_pipeline(device, pm.dp_dim, gm, examples))
            return copy_graph(gm.graph)

        graph = agreed_over_mesh(self.mesh, lowered)

        def swap() -> None:
            swap_graph(pm, graph)
            if pm.__dict__.get("model_on_meta") is not None and EXPORTED_FROM in merged.meta:
                pm.__dict__["model_on_meta"] = meta_copy_to_pickle(merged)  # what export over a mesh copies: both modes

        return swap

    def _compile_rank(self, model: nn.Module, example_inputs: Sequence[Any] | None) -> ParallelModule:
        mode, dp_dim, tp_dim = check_mesh(self.mesh, self.plan)
        if self.data_parallel == "fsdp" and dp_dim is None:
            raise ArgumentError(
                'data_parallel="fsdp" shards over the mesh\'s data-parallel dimension, and this mesh has none '
                f"(dims {tuple(self.mesh.mesh_dim_names or ())}); pass a ('dp',) or ('dp', 'tp') mesh"
            )
        if self.data_parallel == "fsdp":
            check_fsdp_parameters(model)
        return MESH_PROGRAMS[mode].compile(self, model, dp_dim, tp_dim, example_inputs)

    def fsdp_options(self) -> dict[str, Any] | None:
        """``fully_shard``'s keyword arguments where ``data_parallel="fsdp"``, else None."""
        if self.data_parallel != "fsdp":
            return None
        return {} if self.mixed_precision is None else {"mp_policy": self.mixed_precision}

    # ------------------------------------------------------------------ data parallel
    def _random_options(self, devices: Devices, gm: fx.GraphModule, dp_dim: Any, example_inputs: Any = None,
                        plan: Mapping[str, str] | None = None) -> passes.PipelineOptions:  # fmt: skip
        """Options of this rank's passes: its inputs' batch dims (split over ``dp_dim``), ``exact_random``."""
        input_dims = infer_input_dims(gm, example_inputs=example_inputs) if dp_dim is not None else {}
        return passes.PipelineOptions(devices=devices, input_dims=input_dims, plan=dict(plan or {}),
                                      exact_random=self.exact_random)  # fmt: skip

    def _data_parallel_pipeline(self, device: torch.device, dp_dim: str | int | None, gm: fx.GraphModule,
                                example_inputs: Any = None) -> list:  # fmt: skip
        options = self._random_options(Devices((device,)), gm, dp_dim, example_inputs)
        dp_rank, dp_size = self.mesh.get_local_rank(dp_dim), mesh_size(self.mesh, dp_dim)
        scopes = tuple(  # FSDP's blocks: their random ops draw through a scope around the call
            str(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), self.fsdp_blocks)
        ) if self.fsdp_blocks else ()  # fmt: skip
        return (
            passes.frontend_pipeline(options)
            + passes.rank_rows_pipeline(options, dp_rank=dp_rank, dp_size=dp_size, scopes=scopes)
            + passes.exact_random_rank_pipeline(options, tp_rank=None, dp_size=dp_size, scopes=scopes)
            + passes.spmd_pipeline(options, mesh=self.mesh, dp_dim=dp_dim)
            + passes.checkpoint_pipeline(self.checkpointed, self.checkpoint_save)
        )

    def _module_sharing(
        self, model: nn.Module, gm: fx.GraphModule, device: torch.device, mode: str, records: list,
        flags: dict[str, Any], nones: frozenset[str], captured_code: str,
    ) -> ParallelModule:  # fmt: skip
        """This rank's program ``gm`` over ``model``'s own tensors (data and context parallel), which
        fx traces again for a departing call (a GraphModule is not traced again)."""
        pm = ParallelModule(gm, gm.graph, recipe=self, devices=Devices((device,)), mode=mode, output_device=device,
                        records=records, class_name=type(model).__name__, share_all_of=model,
                        source=model if not isinstance(model, fx.GraphModule) else None, flags=flags, none_args=nones)  # fmt: skip
        pm.captured_code = captured_code
        return pm

    def _check_no_exact_random(self, gm: fx.GraphModule, where: str, or_else: str) -> None:
        """Context parallel over a mesh: a random op's single-device values are not drawn on sequence shards yet."""
        drawn = [n for n in gm.graph.nodes if random_kind(gm, n) is not None]
        if drawn and self.exact_random:
            raise DpCompileError(
                f"context parallel over {where}: '{drawn[0].name}' draws random numbers, and drawing the single-device "
                f"values on sequence shards over a mesh is not built yet: pass exact_random=False (each rank draws its "
                f"own){or_else}"
            )

    def _compile_replicated(self, model: nn.Module, dp_dim: Any, tp_dim: Any, example_inputs: Any) -> ParallelModule:
        """Data parallel: under ``data_parallel="fsdp"`` the model's repeated blocks stay calls (``fully_shard``
        hooks their forward), but a block holding a BatchNorm is traced into, so that its statistics are
        synchronised over dp (``sync_batch_norm``); its parameters are sharded with the root's."""
        if self.data_parallel != "fsdp":
            return self._compile_data_parallel(model, dp_dim, example_inputs)
        blocks = tuple(dict.fromkeys(type(model.get_submodule(p)) for p in repeated_blocks(model)))
        blocks = tuple(c for c in blocks if not _holds_batch_norm(model, c))
        recipe = dataclasses.replace(self, leaf_modules=self.leaf_modules + blocks, fsdp_blocks=blocks)
        return recipe._compile_data_parallel(model, dp_dim, example_inputs)

    def _compile_data_parallel(self, model: nn.Module, dp_dim: Any, example_inputs: Sequence[Any] | None) -> ParallelModule:
        device = self.home_device
        model.to(device)
        gm, flags, nones = capture_with_flags(model, self.leaf_modules, example_inputs)
        captured_code = gm.code
        if example_inputs is not None:  # shapes let the batch rules follow the rows through attention's matmuls,
            # so each random site draws this rank's rows of the global batch (stamp_rank_rows)
            propagate_shapes(gm, [x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs])
        gm, records = run_passes(gm, self._data_parallel_pipeline(device, dp_dim, gm, example_inputs))
        pm = self._module_sharing(model, gm, device, "spmd_data_parallel", records, flags, nones, captured_code)
        hold_mesh(pm, mesh=self.mesh, dp_dim=dp_dim, tp_dim=None, ddp_options=self.ddp_options, fsdp=self.fsdp_options())
        return pm

    # ------------------------------------------------------------------ context parallel
    def _compile_context_parallel(self, model: nn.Module, dp_dim: Any, tp_dim: Any, example_inputs: Any) -> ParallelModule:
        """The program one process builds for ``mesh={"cp": N}`` over ``N`` virtual devices, cut to
        this rank's part with its exchanges over the ``cp`` group (``passes.lower_sequence_to_rank``);
        DDP over ``cp`` averages the ranks' gradients, which the program scales so that the average is
        the sum of their shares: the single-device gradient. ``data_parallel="fsdp"``: FSDP2 instead,
        ``fully_shard`` over every rank (``dp x cp`` flattened, as torchtitan's ``dp_shard_cp``): its
        reduce-scatter averages as DDP does."""
        where = f"a {tuple(self.mesh.mesh_dim_names)} mesh"
        if example_inputs is None:
            raise DpCompileError(
                f"context parallel over {where} finds the sequence and attention's shapes from examples: pass "
                "example_inputs= or example_kwargs= (this rank's shard, e.g. input_ids=, labels=)"
            )
        device = self.home_device
        model.to(device)
        gm, flags, nones = capture_with_flags(model, self.leaf_modules, example_inputs)
        captured_code = gm.code
        self._check_no_exact_random(gm, where, ", set its probability to 0, or use mesh={'cp': N} over a device list")
        gm, records = self._lower_context_parallel(gm, device, example_inputs)
        pm = self._module_sharing(model, gm, device, "spmd_context_parallel", records, flags, nones, captured_code)
        ddp_mesh = self._batch_mesh() or self.mesh  # one DDP (or FSDP) over every rank
        hold_mesh(pm, mesh=ddp_mesh, dp_dim=ddp_mesh.mesh_dim_names[0], tp_dim=None, ddp_options=self.ddp_options,
                       fsdp=self.fsdp_options())  # fmt: skip
        return pm

    def _lower_context_parallel(self, gm: fx.GraphModule, device: torch.device, examples: Sequence[Any]) -> tuple:
        """``gm`` (captured) lowered to this cp rank's program, its shapes from ``examples`` (the rank's)."""
        propagate_shapes(gm, [x.to(device) if isinstance(x, torch.Tensor) else x for x in examples], check=True)
        input_dims = infer_input_dims(gm, batch_dim=1, example_inputs=examples)
        input_dims = without_sequence_replicated(gm, input_dims, examples)
        world, rank = mesh_size(self.mesh, "cp"), self.mesh.get_local_rank("cp")
        options = passes.PipelineOptions(devices=Devices((device,) * world), input_dims=dict(input_dims),
                                         output_device=device, context_parallel=True,
                                         context_options=self.context_options, context_ranks=True)  # fmt: skip
        lower = functools.partial(passes.lower_sequence_to_rank, mesh=self.mesh, cp_dim="cp", rank=rank,
                                  input_dims=dict(input_dims), batch_mesh=self._batch_mesh(),
                                  dp_dim="dp" if self.mesh.ndim == 2 else None)  # fmt: skip
        return run_passes(gm, passes.frontend_pipeline(options) + passes.data_parallel_pipeline(options) + [lower])

    def _batch_mesh(self) -> Any:
        """A ``("dp", "cp")`` mesh flattened to one ``dp_cp`` dimension (every rank), else None."""
        return self.mesh._flatten("dp_cp") if self.mesh.ndim == 2 else None

    # ------------------------------------------------------------------ tensor parallel
    def _tensor_parallel_pipeline(self, devices: Devices, styles: Mapping[str, str], dp_dim: Any, tp_dim: Any,
                                  gm: fx.GraphModule, example_inputs: Any = None) -> list:  # fmt: skip
        options = self._random_options(devices, gm, dp_dim, example_inputs, styles)
        dp_rank = self.mesh.get_local_rank(dp_dim) if dp_dim is not None else None
        dp_size = mesh_size(self.mesh, dp_dim) if dp_dim is not None else None
        return (
            passes.frontend_pipeline(options)
            + passes.rank_rows_pipeline(options, dp_rank=dp_rank, dp_size=dp_size)
            + passes.spmd_tensor_parallel_pipeline(options)
            + ([functools.partial(passes.shard_sequence, devices=devices)] if self.sequence_parallel else [])
            + passes.exact_random_rank_pipeline(options, tp_rank=self.mesh.get_local_rank(tp_dim), dp_size=dp_size)
            + passes.spmd_pipeline(options, mesh=self.mesh, dp_dim=dp_dim, tp_dim=tp_dim)
            + passes.checkpoint_pipeline(self.checkpointed, self.checkpoint_save)
        )

    def _compile_tensor_parallel(self, model: nn.Module, dp_dim: Any, tp_dim: Any, example_inputs: Sequence[Any] | None,
                                 lower: Any = None) -> ParallelModule:  # fmt: skip
        """This rank's shards; ``lower(gm, devices, styles, dp_dim, tp_dim, examples)``, where given, lowers the
        one-shard program instead of :meth:`_tensor_parallel_pipeline`."""
        device = self.home_device
        tp_size = mesh_size(self.mesh, tp_dim)
        tp_rank = self.mesh.get_local_rank(tp_dim)
        if self.sequence_parallel and example_inputs is None:
            raise DpCompileError(
                "sequence_parallel=True finds the sequence dim from the example's shapes: pass example_inputs= "
                "(or example_kwargs=)"
            )
        pristine = fake_copy_to_trace(model, device)  # to trace again for calls that depart from this one
        watch_source_parameters(model)  # an optimizer over model.parameters() would train nothing: make it loud
        own = deepcopy_on_fake(model)  # pm owns its shards; the user's model is left unchanged
        move_to(own, device)  # skipped where it is there (a fake copy of a meta model: no memory to move)
        if not any(is_fake(p) for p in own.parameters()):  # fake: a meta model, its values come from load_checkpoint
            broadcast_state(own, self.mesh.get_group(tp_dim))  # every shard cut from the same (tp rank 0's) model
        on_fake = any(is_fake(t) for t in (*own.parameters(), *own.buffers()))  # a meta model's fake copy
        with RealConstants() if on_fake else contextlib.nullcontext():  # `torch.tensor([...])` in forward: a real constant
            gm, flags, nones = capture_with_flags(own, self.leaf_modules + linear_like_leaves(), example_inputs)
        if passes.decompose_attention(gm).modified:  # nn.MultiheadAttention written out, so heads can be sharded
            gm.recompile()
        captured_code = gm.code  # after decompose_attention: its dropout_p follows the mode
        if example_inputs is not None:
            propagate_shapes(gm, [x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs], check=True)
        styles, reasons = plan_for(gm, aliased_plan(self.plan), tp_size, model)
        devices = Devices((device,) * tp_size)  # shard_linear reads how many shards there are
        gm, records = lower(gm, devices, styles, dp_dim, tp_dim, example_inputs) if lower else run_passes(
            gm, self._tensor_parallel_pipeline(devices, styles, dp_dim, tp_dim, gm, example_inputs))
        info = unaliased_findings(info_of(records, "shard_linear"))
        specs = dict(info.get("param_shards", {}))
        keep_own_shards(gm, own, specs, tp_rank)
        specs = {unalias(target): spec for target, spec in specs.items()}  # under the model's names
        specs = share_tied_shard(own, gm, tied_groups(model), specs)  # an unused layer's tied bias: the same shard
        pm = ParallelModule(
            gm,
            gm.graph,
            recipe=self,
            devices=Devices((device,)),
            mode=self.mode,
            output_device=device,
            plan=info.get("plan", styles),
            records=records,
            class_name=type(model).__name__,
            share_all_of=own,
            source=pristine,
            flags=flags,
            none_args=nones,
            shares_source=False,
        )
        pm.captured_code = captured_code
        pm.plan_reasons = {**{unalias(p): why for p, why in reasons.items()}, **{p: f"replicate: {why}" for p, why in info.get("reasons", {}).items()}}
        hold_mesh(
            pm,
            mesh=self.mesh, dp_dim=dp_dim, tp_dim=tp_dim, shards=specs, ddp_options=self.ddp_options, fsdp=self.fsdp_options()
        )
        return pm

    # ------------------------------------------------------------------ context x tensor parallel
    def _compile_context_tensor_parallel(self, model: nn.Module, dp_dim: Any, tp_dim: Any,
                                         example_inputs: Any) -> ParallelModule:  # fmt: skip
        """The tensor-parallel rank program on this cp rank's part of the sequence; what a ``("cp", "tp")``
        mesh does not build yet refused before anything is captured."""
        where = "a ('cp', 'tp') mesh"
        if example_inputs is None:
            raise DpCompileError(
                f"context parallel over {where} finds the sequence and attention's shapes from examples: pass "
                "example_inputs= or example_kwargs= (this cp rank's part, dpcompile.mesh.local_batch)"
            )
        if self.data_parallel == "fsdp":  # sequence_parallel=True is refused by the keyword checks
            raise DpCompileError(
                f'data_parallel="fsdp" with {where} is not built yet: leave it out (the layers\' shards replicated '
                "over cp, their gradients summed over cp by DDP)"
            )
        return self._compile_tensor_parallel(model, dp_dim, tp_dim, example_inputs, self._lower_context_tensor_parallel)

    def _lower_context_tensor_parallel(self, gm: fx.GraphModule, devices: Devices, styles: Mapping[str, str],
                                       dp_dim: Any, tp_dim: Any, examples: Sequence[Any]) -> tuple:  # fmt: skip
        """``("cp", "tp")``: ``shard_linear``'s one-shard program, attention marked on it (each shard gathers
        its own heads' keys and values), split along the sequence over ``cp`` virtual devices and cut to this
        cp rank (``passes.lower_sequence_to_rank``), then its shard collectives lowered over ``tp``."""
        self._check_no_exact_random(gm, "a ('cp', 'tp') mesh", " or set its probability to 0")
        input_dims = infer_input_dims(gm, batch_dim=1, example_inputs=examples)
        input_dims = dict(without_sequence_replicated(gm, input_dims, examples))
        options = passes.PipelineOptions(devices=devices, input_dims=input_dims, plan=dict(styles))
        gm, records = run_passes(gm, passes.frontend_pipeline(options))
        shapes = {n.name: {k: n.meta[k] for k in ("val", "tensor_meta") if k in n.meta} for n in gm.graph.nodes}
        gm, sharded = run_passes(gm, passes.spmd_tensor_parallel_pipeline(options))
        borrow_shapes(gm, shapes)  # the shard program's nodes keep the captured shapes attention is marked by
        gm, marked = run_passes(gm, passes.sequence_exchange_on_shards(input_dims))
        cp_world, cp_rank, device = mesh_size(self.mesh, "cp"), self.mesh.get_local_rank("cp"), devices.primary
        cp_options = passes.PipelineOptions(devices=Devices((device,) * cp_world), input_dims=input_dims,
                                            output_device=device, context_parallel=True,
                                            context_options=self.context_options)  # fmt: skip
        lower = functools.partial(passes.lower_sequence_to_rank, mesh=self.mesh, cp_dim="cp", rank=cp_rank,
                                  input_dims=input_dims)  # fmt: skip
        tp_rank = self.mesh.get_local_rank("tp")
        gm, lowered = run_passes(gm, passes.data_parallel_pipeline(cp_options) + [lower]
                                 + passes.exact_random_rank_pipeline(options, tp_rank=tp_rank, dp_size=None)
                                 + passes.spmd_pipeline(options, mesh=self.mesh, tp_dim="tp"))  # fmt: skip
        return gm, records + sharded + marked + lowered

    # ------------------------------------------------------------------ variants
    def build_program(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        if pm.traced_model is None:
            raise pm.cannot_trace_again(key)
        return MESH_PROGRAMS[self.mode].build_again(self, pm, key, args, kwargs)

    def _refuse_again(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> None:
        raise DpCompileError(
            f"the call ({key.describe()}) takes another path through forward than the one traced, and tracing "
            "again over a ('cp', 'tp') mesh is not built yet: transform the model for that call (its mode, its "
            "arguments given or left None)"
        )

    def _traced_again(self, pm: ParallelModule, key: CallKey) -> fx.GraphModule | None:
        """The model traced again for ``key`` (a program on the model's own tensors: data and context
        parallel, where every rank departs alike); None where it traces as the main program."""
        with modes_applied(pm.traced_model, key.modes):
            traced = capture(pm.traced_model, leaf_modules=self.leaf_modules, none_args=key.none_args,
                             flags=dict(key.flags) or None)  # fmt: skip
        return None if traced.code == pm.captured_code else traced

    def _context_parallel_again(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        if (traced := self._traced_again(pm, key)) is None:
            return None
        lowered, _ = self._lower_context_parallel(traced, pm.devices.primary, list(bind_inputs(pm, args, kwargs)))
        return graph_module(pm, copy_graph(lowered.graph), "SpmdVariant")

    def _data_parallel_again(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        if (traced := self._traced_again(pm, key)) is None:
            return None
        lowered, _ = run_passes(traced, self._data_parallel_pipeline(pm.devices.primary, pm.dp_dim, traced))
        return graph_module(pm, copy_graph(lowered.graph), "SpmdVariant")

    def _tensor_parallel_again(self, pm: ParallelModule, key: CallKey, args: tuple, kwargs: dict) -> fx.GraphModule | None:
        """The model's pristine fake copy traced again for ``key``, sharded by ``pm``'s plan: its shards
        must be ``pm``'s."""
        source, flags, device = pm.traced_model, dict(key.flags) or None, pm.devices.primary
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with modes_applied(source, key.modes):
            leaves = self.leaf_modules + linear_like_leaves()  # Conv1D-like layers stay calls, as in _compile_tensor_parallel
            again = capture(source, leaf_modules=leaves, none_args=key.none_args, flags=flags)
            if passes.decompose_attention(again).modified:  # as compile does: the attention dropout follows the mode
                again.recompile()
            if again.code == pm.captured_code:
                return None
            fake = fake_copy(source, mode, device)
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            with modes_applied(fake, key.modes):
                traced = capture(fake, leaf_modules=leaves, none_args=key.none_args, flags=flags)
            example = tree_map(lambda v: mode.from_tensor(v.detach()) if isinstance(v, torch.Tensor) else v,
                               bind_inputs(pm, args, kwargs))  # fmt: skip
            if passes.decompose_attention(traced).modified:
                traced.recompile()
            propagate_shapes(traced, list(example))
            devices = Devices((device,) * mesh_size(self.mesh, pm.tp_dim))
            plan = aliased_plan(pm.plan)
            pipeline = self._tensor_parallel_pipeline(devices, plan, pm.dp_dim, pm.tp_dim, traced)
            lowered, records = run_passes(traced, pipeline)
        shards = {unalias(t): spec for t, spec in info_of(records, "shard_linear").get("param_shards", {}).items()}
        if shards != pm.shards:
            raise DpCompileError(
                f"the call ({key.describe()}) takes another path through forward, whose layers shard "
                "differently; transform the model for that call"
            )
        return graph_module(pm, copy_graph(lowered.graph), "SpmdVariant")


@dataclass(frozen=True)
class MeshProgram:
    """One kind of rank program over a mesh, recorded once (:data:`MESH_PROGRAMS`, keyed by the mode
    ``check_mesh`` names): how :class:`SpmdRecipe` builds it, and how it builds it again for a call that
    departs from the first. A new kind of mesh program is an entry, not a branch."""

    compile: Callable[..., ParallelModule]  # (recipe, model, dp_dim, tp_dim, example_inputs)
    build_again: Callable[..., fx.GraphModule | None]  # (recipe, pm, key, args, kwargs)


_TENSOR_PARALLEL = MeshProgram(SpmdRecipe._compile_tensor_parallel, SpmdRecipe._tensor_parallel_again)
MESH_PROGRAMS: dict[str, MeshProgram] = {
    "spmd_data_parallel": MeshProgram(SpmdRecipe._compile_replicated, SpmdRecipe._data_parallel_again),
    "spmd_tensor_parallel": _TENSOR_PARALLEL,
    "spmd_2d": _TENSOR_PARALLEL,
    "spmd_context_parallel": MeshProgram(SpmdRecipe._compile_context_parallel, SpmdRecipe._context_parallel_again),
    "spmd_context_tensor_parallel": MeshProgram(SpmdRecipe._compile_context_tensor_parallel, SpmdRecipe._refuse_again),
}


def example_specs(example_inputs: Sequence[Any] | None) -> tuple[Any, ...] | None:
    """The examples a rank's program was shaped by, as ``(shape, dtype)`` per tensor (other values as they
    are), None without examples: ``dpcompile.export`` over a mesh records them, and ``load`` lowers with
    zeros of those shapes, so that the loaded program is the one exported."""
    if example_inputs is None:
        return None
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in example_inputs)


def _holds_batch_norm(model: nn.Module, block_class: type[nn.Module]) -> bool:
    """Whether a repeated block of ``block_class`` in ``model`` holds a BatchNorm: called whole under FSDP, it
    would normalise with this rank's batch alone (the lowering that synchronises it never sees inside)."""
    from passes.collectives import BATCH_NORMS

    return any(
        isinstance(m, BATCH_NORMS) for p in repeated_blocks(model) if type(model.get_submodule(p)) is block_class
        for m in model.get_submodule(p).modules()
    )  # fmt: skip


@torch.no_grad()
def broadcast_state(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Give every rank of ``group`` the parameters and buffers of the group's first rank.

    As DDP does at construction: ranks that initialised the model differently (no common
    seed) still cut their shards from one model.
    """
    source = dist.get_global_rank(group, 0)
    try:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)
    except (RuntimeError, dist.DistError) as e:
        raise collective_failure("transform's broadcast of the first tp rank's parameters", group, e) from e


def keep_own_shards(gm: fx.GraphModule, own: nn.Module, specs: Mapping[str, Any], rank: int) -> None:
    """Replace each sharded parameter by this rank's shard (a new parameter; the rest is dropped).
    Tied weights (an embedding and its LM head) get one shard, shared as the model shares them."""
    made: dict[int, nn.Parameter] = {}
    for target, spec in specs.items():
        path, _, name = target.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        full = getattr(owner, name)
        if id(full) not in made:
            with torch.no_grad():
                shard = shard_of(full.detach(), spec, rank).clone()
            made[id(full)] = nn.Parameter(shard, requires_grad=full.requires_grad)
        param = made[id(full)]
        setattr(owner, name, param)
        if not path:  # the model itself is a Linear: its own parameters are the root's
            setattr(own, name, param)
        else:  # a weight forward only reads (torchvision Swin's qkv): gm holds it in a container of its own
            try:
                own_owner = own.get_submodule(path)
            except AttributeError:
                continue
            if own_owner is not owner:
                setattr(own_owner, name, param)
