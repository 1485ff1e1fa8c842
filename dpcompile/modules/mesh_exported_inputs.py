"""The argument check of a program over a ``DeviceMesh`` captured with ``frontend="export"``.

torch.export fixed the call's structure (which arguments, which are tensors), dtypes and every dim
the examples did not say varies. One process refuses a call that departs from them with an
:class:`~dpcompile.capture.inputs.InputMismatch` naming the argument (``ExportedModelCheck``); a rank
over a mesh checks the same, and the ranks agree on it before any collective of the call, so that
a rank whose own call is refused never leaves the others waiting in a collective it never joins:

    hold_exported_inputs(pm, captured.meta[EXPORTED_FROM])   # at transform, every rank
    check_exported_inputs_over_mesh(pm, args, kwargs)        # first thing in each call, every rank

Every rank of the mesh raises: the refused rank its ``InputMismatch``, the others one naming that rank
and its reason. The agreement is one 8-byte all-gather along each mesh dimension (a refusal learnt
along one dimension is carried into the next, so after the last every rank knows). With
``pm.check_inputs = False`` (no cross-rank checks) a rank checks its own call only.
"""

from __future__ import annotations

from typing import Any

from dpcompile.capture.inputs import ExportedFrom, InputMismatch, InputSpec, check_inputs
from dpcompile.modules.spmd_exchange import start_exchange
from dpcompile.runtime.distributed import MeshGroup

#: ``pm.__dict__`` key: ``(input specs, the model's class name)`` of the export the program was built from
EXPORTED_INPUTS = "exported_inputs_over_mesh"


def hold_exported_inputs(pm: Any, exported: ExportedFrom | None) -> None:
    """Keep what export fixed of the call (``exported``: the capture's record; None: not exported)."""
    if exported is not None and exported.inputs:
        hold_input_specs(pm, (tuple(exported.inputs), type(exported.model).__name__))


def hold_input_specs(pm: Any, held: tuple[tuple[InputSpec, ...], str] | None) -> None:
    """Keep ``(input specs, the model's class name)``: a loaded program's record (``pickling.exported_inputs``)."""
    if held is not None:
        pm.__dict__[EXPORTED_INPUTS] = held


def check_exported_inputs_over_mesh(pm: Any, args: tuple, kwargs: dict) -> None:
    """Raise ``InputMismatch`` on every rank of the mesh where any rank's call departs from what export
    fixed; nothing (and no collective) for a program not captured with the export frontend."""
    held = pm.__dict__.get(EXPORTED_INPUTS)
    if held is None:
        return
    refusal = None
    try:
        check_inputs(held[0], args, kwargs, held[1])
    except InputMismatch as e:
        refusal = e
    if pm.check_inputs:
        import torch.distributed as dist

        mine = "" if refusal is None else f"global rank {dist.get_rank()}: {refusal}"
        found = _refusal_anywhere(pm, mine)
        if refusal is None and found:
            raise InputMismatch(
                f"another rank's call was refused, so this rank's is too (no rank may enter the step without the "
                f"others): {found}"
            )
    if refusal is not None:
        raise refusal


def _refusal_anywhere(pm: Any, mine: str) -> str:
    """The first refusal any rank of the mesh reports ("" where none): one exchange along each dimension,
    each rank carrying into the next what it learnt from the last."""
    mesh = pm.mesh
    for dim in mesh.mesh_dim_names or range(mesh.ndim):
        signatures = start_exchange(pm, MeshGroup(mesh, dim), [("refused", mine)], "export-frontend argument")()
        if signatures is not None and not mine:
            mine = next(text for signature in signatures for _, text in signature if text)
    return mine
