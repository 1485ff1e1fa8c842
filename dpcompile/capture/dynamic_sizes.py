"""``dynamic_dims=`` that the captured program does not honour, refused at ``transform``.

``torch.export`` keeps a dim dynamic only as far as the model's code lets it: code that turns the
size into a Python value (Funnel's ``list(range(seq_len))``) fixes it to the example's size, and a
branch on it (LongT5's ``if seq_len % block_len``) keeps the example's side with a guard that the
program does not check. Either way a call at another size would fail inside the program with a bare
``RuntimeError`` (or run the wrong branch). Before anything is built:

    refuse_fixed_dynamic_dims(gm, dynamic_dims, "FunnelModel")      # a dim export fixed: its line
    refuse_unserved_sizes(gm, examples, dynamic_dims, "LongT5Model") # a fake run at size + 1 fails
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from dpcompile.capture.errors import user_source
from dpcompile.capture.export_inputs import varying_dims
from dpcompile.capture.inputs import is_dynamic
from dpcompile.errors import TraceError

_WAY_OUT = "transform once per size (each program refuses other sizes by name), or use frontend='fx' where the model traces"


def refuse_fixed_dynamic_dims(gm: fx.GraphModule, dynamic_dims: Any, model_name: str) -> None:
    """Raise :class:`~dpcompile.errors.TraceError` where a dim ``dynamic_dims=`` says varies was
    fixed by export (the model's code turned it into a Python int: ``list(range(seq_len))``), so
    that the program serves only the example's size. With ``{argument: dims}`` every named dim
    counts; with ``[dims]`` for every tensor a dim counts where no argument kept it dynamic (an
    image's channel dim is fixed, the sequence's varies).

    Before: ``dynamic_dims=[1]`` on Funnel, a call at another length fails inside the program
    with a bare ``RuntimeError``. After: ``transform`` says which dim and which line fixed it."""
    if dynamic_dims is None:
        return
    fixed: list[tuple[str, int, int]] = []
    kept: set[int] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            continue
        for dim in varying_dims(dynamic_dims, str(node.target)):
            if dim < val.dim():
                if is_dynamic(val.shape[dim]):
                    kept.add(dim)
                else:
                    fixed.append((str(node.target), dim, int(val.shape[dim])))
    if not isinstance(dynamic_dims, Mapping):
        fixed = [f for f in fixed if f[1] not in kept]
    if not fixed:
        return
    name, dim, size = fixed[0]
    where = _fixing_lines(gm)
    raise TraceError(
        f"dynamic_dims= says dim {dim} of '{name}' varies, but torch.export fixed it to the example's {size} while "
        f"capturing {model_name}{' (' + where + ')' if where else ''}: its code turns that size into a Python value, so "
        f"the program serves only size {size}. Leave dim {dim} out of dynamic_dims= and {_WAY_OUT}"
    )


def _fixing_lines(gm: fx.GraphModule) -> str:
    """Where export fixed a symbol to a number, outside torch itself: ``modeling_funnel.py:152``."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape_env = next((d.node.shape_env for d in getattr(val, "shape", ()) if isinstance(d, torch.SymInt)), None)
        if shape_env is None:
            continue
        lines = []
        for symbol, value in shape_env.replacements.items():
            loc = getattr(getattr(shape_env, "replacements_slocs", {}).get(symbol), "framework_loc", None)
            if getattr(value, "is_number", False) and loc is not None and "/torch/" not in loc.filename:
                lines.append(f"{loc.filename.rsplit('/', 1)[-1]}:{loc.lineno} in {loc.name}")
        return "; ".join(dict.fromkeys(lines))
    return ""


def refuse_unserved_sizes(gm: fx.GraphModule, examples: Sequence[Any], dynamic_dims: Any, model_name: str) -> None:
    """Raise :class:`~dpcompile.errors.TraceError` where the program, run on fake tensors, takes the
    examples but not the examples one longer on the dims ``dynamic_dims=`` names (a branch on the
    size that export decided on the example, e.g. LongT5's padding to a multiple of its block).
    Nothing is checked where the fake run cannot take the examples themselves.

    Before: a call at another length fails in a ``reshape`` with a bare ``RuntimeError``. After:
    ``transform`` names the dim and the line of forward whose op failed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if dynamic_dims is None or len(placeholders) != len(examples):
        return
    grown, named = [], None
    for node, value in zip(placeholders, examples):
        dims = [d for d in varying_dims(dynamic_dims, str(node.target)) if isinstance(value, torch.Tensor) and d < value.dim()]
        if dims:
            named = named or (str(node.target), dims[0], int(value.shape[dims[0]]))
            size = list(value.shape)
            for d in dims:
                size[d] += 1
            value = value.new_zeros(size)
        grown.append(value)
    if named is None:
        return
    failed: dict[str, Any] = {}

    class Recording(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            try:
                return super().run_node(node)
            except Exception:
                failed.setdefault("node", node)
                raise

    def runs(values: Sequence[Any]) -> bool:
        failed.clear()
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                Recording(gm).run(*values)
        except Exception:  # noqa: BLE001 - any failure of the program at that size
            return False
        return True

    if not runs(examples) or runs(grown):
        return
    name, dim, size = named
    node = failed.get("node")
    where = user_source(node) if node is not None else None
    line = f" ({where})" if where else ""
    raise TraceError(
        f"dynamic_dims= says dim {dim} of '{name}' varies, but the program captured from {model_name} fails at "
        f"size {size + 1} (the example's {size} + 1){line}: torch.export kept the example's side of a branch on that size. "
        f"Leave dim {dim} out of dynamic_dims= and {_WAY_OUT}"
    )
