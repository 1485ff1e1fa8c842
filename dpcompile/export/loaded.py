"""Loaded programs: one per variant (mode × optional arguments left None), picked per call.

A loaded folder has no user class to trace again, so export traces the model's variants
ahead (train and eval mode, and each pattern of optional arguments left None) and stores
each distinct program. A call picks the program for ``(self.training, {arguments None})``
and refuses, with a :class:`~dpcompile.DpCompileError`, a call it has none for, or one
with a flag argument other than the one the program was traced for: it never runs the
wrong program.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch.fx as fx
from torch import nn

from dpcompile.errors import DpCompileError
from dpcompile.module import ParallelModule, copy_graph
from dpcompile.tensor_parallel import TensorParallelModule

log = logging.getLogger("dpcompile")

__all__ = ["LoadedParallelModule", "LoadedTensorParallelModule", "VariantTable", "collect_variants"]

MAX_PATTERNS = 8  # patterns of optional arguments (times flag values) traced ahead, per mode


class VariantTable(dict):
    """``{(training, frozenset of None arguments, flag values): program index}`` plus how to
    read a call (``flag values``: a tuple of ``(name, value)`` in the order of ``flags``)."""

    def __init__(self, table: dict, *, optional: list, flags: list, traced: list, known: bool):
        super().__init__(table)
        self.optional = [tuple(x) for x in optional]  # (position, name)
        self.flags = [tuple(x) for x in flags]  # (position, name, default, traced value)
        self.traced = list(traced)  # modules forward is traced through: their mode is the program's
        self.known = known

    def to_json(self) -> dict[str, Any]:
        from dpcompile.export.serialize import encode_value

        return {
            "known": self.known,
            "optional": [[p, n] for p, n in self.optional],
            "flags": [[p, n, encode_value(d), encode_value(v)] for p, n, d, v in self.flags],
            "traced_through": self.traced,
            "table": [
                {"training": t, "none": sorted(nones), "flags": [[n, encode_value(v)] for n, v in f], "program": i}
                for (t, nones, f), i in self.items()
            ],
        }

    @classmethod
    def from_json(cls, data: Any, programs: int) -> VariantTable:
        from dpcompile.export.common import ExportError
        from dpcompile.export.serialize import decode_value

        try:
            table = {}
            for row in data["table"]:
                index = row["program"]
                if type(index) is not int or not 0 <= index < programs or type(row["training"]) is not bool:
                    raise ValueError(row)
                values = tuple((str(n), decode_value(v)) for n, v in row["flags"])
                table[(row["training"], frozenset(str(n) for n in row["none"]), values)] = index
            optional = [(int(p), str(n)) for p, n in data["optional"]]
            flags = [(int(p), str(n), decode_value(d), decode_value(v)) for p, n, d, v in data["flags"]]
            traced = [str(p) for p in data["traced_through"]]
            return cls(table, optional=optional, flags=flags, traced=traced, known=bool(data["known"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"program.json: a variant table it cannot read ({e!r:.80})") from None


class _Variants:
    """What both loaded classes add: the variant table and the programs beside ``self``."""

    def _attach_variants(self, table: VariantTable, siblings: dict[int, nn.Module]) -> None:
        object.__setattr__(self, "_loaded_variants", table)
        object.__setattr__(self, "_loaded_siblings", dict(siblings))

    def loaded_program(self, args: tuple, kwargs: dict) -> nn.Module | None:
        """The program a call runs: None for ``self``'s own, else a sibling; raises where none fits."""
        table: VariantTable | None = self.__dict__.get("_loaded_variants")
        if table is None or not table.known:
            return None
        flags = tuple(
            (name, args[position] if position < len(args) else kwargs.get(name, default))
            for position, name, default, _ in table.flags
        )
        carried = {f for _, _, f in table}
        for name, actual in flags:
            if not any(any(n == name and type(v) is type(actual) and v == actual for n, v in f) for f in carried):
                values = sorted({repr(v) for f in carried for n, v in f if n == name})
                raise DpCompileError(
                    f"this loaded program was traced for {name} in {', '.join(values)}; the call passes "
                    f"{name}={actual!r}. A loaded program cannot trace again: export a program transformed for that value"
                )
        nones = frozenset(
            name for position, name in table.optional
            if (args[position] if position < len(args) else kwargs.get(name)) is None
        )  # fmt: skip
        mode = bool(self.training)  # type: ignore[attr-defined]
        for path in table.traced:
            module = self.get_submodule(path)  # type: ignore[attr-defined]
            if module.training != mode:
                raise DpCompileError(
                    f"'{path}' is in {'training' if module.training else 'eval'} mode but the loaded module in "
                    f"{'training' if mode else 'eval'} mode; a loaded program carries programs for the whole "
                    "model in one mode: call pm.train() or pm.eval()"
                )
        index = next(
            (i for (t, n, f), i in table.items() if t == mode and n == nones and _same(f, flags)), None
        )
        if index is None:
            carried = ", ".join(
                f"{'train' if t else 'eval'} with {sorted(n) or 'no'} None" + "".join(f", {k}={v!r}" for k, v in f)
                for (t, n, f) in sorted(table, key=str)
            )
            raise DpCompileError(
                f"this loaded program carries no program for a call in {'training' if mode else 'eval'} mode with "
                f"{sorted(nones) or 'no'} optional argument(s) None (it carries: {carried}); pass those arguments, "
                "or transform the model again where its class is importable"
            )
        return None if index == 0 else self._loaded_siblings[index]


class LoadedParallelModule(_Variants, ParallelModule):
    """A data-parallel :class:`~dpcompile.ParallelModule` read by :func:`dpcompile.load`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program = self.loaded_program(args, kwargs)
        if program is None:
            return super().__call__(*args, **kwargs)
        program.training = self.training
        return program(*args, **kwargs)

    def _extra_state_for_pickle(self) -> dict[str, Any]:
        return {**super()._extra_state_for_pickle(), **_variant_state(self)}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        super()._restore_extra_state(extra)
        _restore_variants(self, extra)


class LoadedTensorParallelModule(_Variants, TensorParallelModule):
    """A :class:`~dpcompile.tensor_parallel.TensorParallelModule` read by :func:`dpcompile.load`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program = self.loaded_program(args, kwargs)
        if program is None:
            return super().__call__(*args, **kwargs)
        program.training = self.training
        return program(*args, **kwargs)

    def _extra_state_for_pickle(self) -> dict[str, Any]:
        return {**super()._extra_state_for_pickle(), **_variant_state(self)}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        super()._restore_extra_state(extra)
        _restore_variants(self, extra)


def _variant_state(pm: nn.Module) -> dict[str, Any]:
    table = pm.__dict__.get("_loaded_variants")
    siblings = pm.__dict__.get("_loaded_siblings", {})
    graphs = {
        k: (copy_graph(s.graph), copy_graph(s._captured_graph) if getattr(s, "_captured_graph", None) is not None else None)
        for k, s in siblings.items()
    }
    return {"loaded_variants": None if table is None else table.to_json(), "loaded_graphs": graphs}


def _restore_variants(pm: nn.Module, extra: dict[str, Any]) -> None:
    data = extra.get("loaded_variants")
    if data is None:
        return
    graphs = extra.get("loaded_graphs", {})
    table = VariantTable.from_json(data, 1 + max(graphs, default=0))
    pm._attach_variants(table, {k: sibling(pm, g, c) for k, (g, c) in graphs.items()})


def sibling(pm: ParallelModule, graph: fx.Graph, captured: fx.Graph | None) -> nn.Module:
    """The program of another variant, sharing ``pm``'s modules and weights."""
    if isinstance(pm, TensorParallelModule):
        return fx.GraphModule(pm, graph, "TensorParallelVariant")
    lower = None
    if captured is not None:
        from dpcompile.api import data_parallel_lowering

        lower = data_parallel_lowering(pm.input_dims, pm.output_device)
    return ParallelModule(
        pm,
        graph,
        devices=pm.devices,
        mode=pm.mode,
        input_dims=pm.input_dims,
        output_device=pm.output_device,
        plan=pm.plan,
        captured_graph=captured,
        lower=lower,
        class_name=type(pm).__name__,
        share_all_of=pm,
    )


# ------------------------------------------------------------------------ at export
def _patterns(optional: list[str]) -> list[frozenset[str]]:
    """Which optional arguments to trace as None: every subset where few, else none, all, each one."""
    subsets = [frozenset(c) for r in range(len(optional) + 1) for c in itertools.combinations(optional, r)]
    if len(subsets) <= MAX_PATTERNS:
        return subsets
    return [frozenset(), frozenset(optional), *(frozenset({o}) for o in optional)]


def _traced_through(pm: nn.Module, source: nn.Module, used: Iterable[str]) -> list[str]:
    """Paths of the modules whose forward fx traced through (user classes and torch.nn
    containers, not called as leaves): their mode is part of what the program was traced for."""
    used = list(used)
    tree = {path for path, _ in pm.named_modules()}
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return [
        path
        for path, module in source.named_modules()
        if path in tree and path
        and not any(path == u or path.startswith(u + ".") for u in used)
        and (not type(module).__module__.startswith("torch.nn") or type(module) in containers)
    ]  # fmt: skip


def collect_variants(pm: ParallelModule, used: Iterable[str]) -> tuple[VariantTable, list[tuple[fx.GraphModule, fx.Graph | None]]]:
    """Trace ``pm``'s model in train and eval mode with each pattern of optional arguments
    None; returns the table and the programs beyond the main one (index 1, 2, ...), each as
    ``(lowered GraphModule, captured graph or None)``."""
    if isinstance(pm, TensorParallelModule):
        source = pm.__dict__.get("_tp_source")
        optional = list(getattr(pm, "_tp_optional", []))
        flags: list = []
    else:
        source = pm.__dict__.get("_source")
        optional = list(getattr(pm, "_optional_inputs", []))
        values = dict(getattr(pm, "_flags", {}))
        flags = [(p, n, d, values[n]) for p, n, d in getattr(pm, "_flag_inputs", [])]
    if source is None:
        return VariantTable({}, optional=[], flags=[], traced=[], known=False), []
    traced_values = tuple((n, v) for _, n, _, v in flags)
    try:
        traced = _traced_through(pm, source, used)
        table, programs = _trace_all(pm, source, optional, traced_values)
    except Exception as e:  # noqa: BLE001 - the module changed under us: carry the main program only
        log.warning("export: cannot trace the model's variants (%s); the loaded program runs only calls like the traced one", e)
        traced = [path for path, _ in pm.named_modules() if path and path not in set(used)]
        training = getattr(pm, "_traced_training", None)
        table, programs = {(bool(pm.training if training is None else training), frozenset(), traced_values): 0}, []
    return VariantTable(table, optional=optional, flags=flags, traced=list(traced), known=True), programs


def _flag_choices(traced: tuple[tuple[str, Any], ...]) -> list[tuple[tuple[str, Any], ...]]:
    """The flag values to trace: the traced ones, and where there are at most two bool flags,
    every combination of them."""
    if not traced or sum(type(v) is bool for _, v in traced) > 2:
        return [traced]
    options = [[v, not v] if type(v) is bool else [v] for _, v in traced]
    return [tuple(zip([n for n, _ in traced], combo)) for combo in itertools.product(*options)]


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(n == m and type(v) is type(w) and v == w for (n, v), (m, w) in zip(a, b))


def _trace_all(
    pm: ParallelModule, source: nn.Module, optional: list, traced_values: tuple[tuple[str, Any], ...]
) -> tuple[dict, list]:
    main_code = _main_code(pm)
    programs: list[tuple[fx.GraphModule, fx.Graph | None]] = []
    by_code: dict[str, int] = {main_code: 0}
    table: dict[tuple[bool, frozenset[str], tuple], int] = {}
    modes = {id(m): m.training for m in source.modules()}
    try:
        for training in (True, False):
            source.train(training)
            patterns, choices = _patterns([name for _, name in optional]), _flag_choices(traced_values)
            if len(patterns) * len(choices) > MAX_PATTERNS:  # bound the traces: flags as traced only
                choices = [traced_values]
            for nones, values in itertools.product(patterns, choices):
                try:
                    code, program, captured = _trace_variant(pm, source, nones, dict(values))
                except Exception as e:  # noqa: BLE001 - a call this program then refuses
                    log.info("export: no program for %s mode with %s None, %s (%s)", training, sorted(nones), values, e)
                    continue
                if code not in by_code:
                    if program is None:
                        continue
                    by_code[code] = len(programs) + 1
                    programs.append((program, captured))
                table[(training, nones, values)] = by_code[code]
    finally:
        for m in source.modules():
            m.training = modes.get(id(m), m.training)
    return table, programs


def _main_code(pm: ParallelModule) -> str:
    if isinstance(pm, TensorParallelModule):
        return pm.code
    return pm._captured_graph.python_code("self").src if pm._captured_graph is not None else pm.code


def _trace_variant(
    pm: ParallelModule, source: nn.Module, nones: frozenset[str], flags: dict[str, Any]
) -> tuple[str, fx.GraphModule | None, fx.Graph | None]:
    if isinstance(pm, TensorParallelModule):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from dpcompile.tensor_parallel import transform_tensor_parallel
        from dpcompile.verify import _FakeCudaOnCpuTorch

        with FakeTensorMode(allow_non_fake_inputs=True), _FakeCudaOnCpuTorch(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            built = transform_tensor_parallel(
                source, pm.devices, plan=pm.plan, output_device=pm.output_device,
                leaf_modules=getattr(pm, "_tp_leaf_modules", ()), check_available=False, none_args=nones,
            )  # fmt: skip
        if built.code == pm.code:
            return built.code, None, None
        if built.param_shards != pm.param_shards:
            raise DpCompileError("this variant's layers shard differently")
        return built.code, fx.GraphModule(pm, copy_graph(built.graph), "TensorParallelVariant"), None
    from dpcompile.api import recapture

    gm = recapture(source, pm.devices, pm._leaf_modules, nones, flags)
    code = gm.graph.python_code("self").src
    if pm._captured_graph is not None and code == pm._captured_graph.python_code("self").src:
        return code, None, None
    captured = copy_graph(gm.graph)
    lowered = pm._lower(fx.GraphModule(gm, copy_graph(gm.graph), "Variant"), pm.devices)
    return code, lowered, captured
