"""The fake devices a layout with ``cp`` composed in one process is rebuilt on (``verify(fake_devices=)``).

In one process, cp composed with dp, tp or pp runs every copy on copy 0's devices (``dpcompile.target.
check_virtual_copies``, ``check_virtual_pieces``): the dims that copy the program (dp and cp) repeat
devices, the others (tp, pp) take devices of their own; ``{"dp": D, "cp": C}`` runs on one device. So the check places the program as
it runs on GPUs: ``{"cp": 2, "tp": 2}`` over fake ``cuda:0..3`` is built on
``["cuda:0", "cuda:1", "cuda:0", "cuda:1"]`` (each piece of the sequence on the tp pair), and
``{"pp": 2, "cp": 2}`` on ``["cuda:0", "cuda:0", "cuda:1", "cuda:1"]`` (each stage on its own device).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from dpcompile.devices import Devices
from dpcompile.errors import DpCompileError
from dpcompile.fake import fake_devices
from dpcompile.target import replicate_over_dp, resolve_target


def composed_sequence_layout(pm: Any) -> dict[str, int] | None:
    """``pm``'s layout where it composes ``cp`` with another dim in one process; None otherwise."""
    layout = {name: size for name, size in (getattr(pm, "layout", None) or {}).items() if size > 1}
    return layout if "cp" in layout and len(layout) > 1 else None


def copying_dims(layout: Mapping[str, int]) -> set[str]:
    """The dims whose copies share copy 0's devices (of those in ``layout``): dp and cp."""
    return {"dp", "cp"} & set(layout)


def repeated_devices(layout: Mapping[str, int], devices: Devices) -> list[str]:
    """One device per place of ``layout`` (in its order, the last dim fastest): the ``k``-th of
    ``devices`` where ``k`` counts over the dims that do not copy (:func:`copying_dims`).

    >>> repeated_devices({"cp": 2, "tp": 2}, fake_devices(4))
    ['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']
    >>> repeated_devices({"pp": 2, "cp": 2}, fake_devices(4))
    ['cuda:0', 'cuda:0', 'cuda:1', 'cuda:1']
    """
    names, copying = list(layout), copying_dims(layout)
    own = [i for i, name in enumerate(names) if name not in copying]
    placed = []
    for index in itertools.product(*(range(layout[name]) for name in names)):
        k = 0
        for i in own:
            k = k * layout[names[i]] + index[i]
        placed.append(str(devices[k]))
    return placed


def sequence_build_fields(layout: Mapping[str, int], devices: Devices) -> tuple[Devices, dict[str, Any], str]:
    """Copy 0's devices, the recipe's ``dp_devices`` and a note, for rebuilding a program of ``layout``
    (:func:`composed_sequence_layout`'s) on fake ``devices`` as the builder lays it out."""
    needed = math.prod(layout.values())
    if len(devices) != needed:
        sizes = " x ".join(f"{name} {size}" for name, size in layout.items())
        raise DpCompileError(
            f"verify(fake_devices={len(devices)}): this program's layout ({sizes}) runs on {needed} devices, not "
            f"{len(devices)}; pass fake_devices={needed}"
        )
    placed = repeated_devices(layout, devices)
    target = resolve_target(fake_devices(placed), layout, pipeline=None, tensor_parallel=False)
    assert target is not None
    arguments = replicate_over_dp(target, micro_batches=1)
    copying = " and ".join(f"'{name}'" for name in sorted(copying_dims(layout)))
    note = (f"fake layout with 'cp': in one process each {copying} copy runs on copy 0's devices, so its {needed} "
            f"places were checked on {', '.join(dict.fromkeys(placed))}")
    return arguments["devices"], {"dp_devices": arguments["dp_devices"]}, note
