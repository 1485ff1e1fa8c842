"""Non-persistent buffers a checkpoint does not hold, computed as the model's own code computes them.

A model built on ``meta`` has its rotary ``inv_freq`` or BERT's ``position_ids`` on meta too,
and no checkpoint holds them (``persistent=False``). They are what the owning module's
constructor computes, so :func:`compute_buffers` builds a fresh instance of that module from
its ``config`` or its parents' (transformers' modules: ``LlamaRotaryEmbedding(config)``) with its
parameters on ``meta`` — only its buffers get memory, on the CPU — and takes them; where the
module takes no config (Gemma 2's scaled embedding), the nearest module above it that a config
builds. Where none can be rebuilt that way, :class:`BuffersNotComputedError` names the buffers
and the ways out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from dpcompile.checkpoint.headers import CheckpointError
from dpcompile.modules.weights import BUFFER_COMPUTERS

log = logging.getLogger("dpcompile")


class BuffersNotComputedError(CheckpointError):
    """Non-persistent buffers that were on meta, which neither the checkpoint nor their module can give."""


def compute_buffers(source: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{name: value on the CPU}`` for the non-persistent buffers ``names`` of ``source``
    (the model ``transform`` was given), each from a fresh instance of its module.

    >>> compute_buffers(llama_on_meta, ["model.rotary_emb.inv_freq"])  # doctest: +SKIP
    {'model.rotary_emb.inv_freq': tensor([1.0000, 0.1000, ...])}
    """
    fresh: dict[str, nn.Module | None] = {}
    out: dict[str, torch.Tensor] = {}
    failed: list[str] = []
    for name in names:
        path, _, attr = name.rpartition(".")
        owner = source.get_submodule(path)
        expected = owner._buffers.get(attr)
        value = rebuilt_buffer(source, path, attr, fresh, expected)
        if value is None:
            failed.append(f"'{name}' ({type(owner).__name__})")
        else:
            out[name] = value if expected is None else value.to(expected.dtype)
    if failed:
        raise BuffersNotComputedError(
            f"non-persistent buffer(s) {', '.join(failed)} were on the meta device, are not in the checkpoint, and "
            "cannot be computed: their module cannot be built afresh from a `config` (its own or a parent's). Build the model with "
            "accelerate's init_empty_weights(include_buffers=False) (buffers stay real), register them with "
            "persistent=True so the checkpoint holds them, or pass strict=False and fill them yourself"
        )
    return out


BUFFER_COMPUTERS.append(compute_buffers)  # pm.load_state_dict(full) computes them as load_checkpoint does


def rebuilt_buffer(
    source: nn.Module, path: str, attr: str, fresh: dict[str, nn.Module | None], expected: torch.Tensor | None
) -> torch.Tensor | None:
    """Buffer ``attr`` of the module at ``path`` as a fresh build computes it: of that module built
    from a config, else of the outermost module above it that a config builds (Gemma 2's
    ``Gemma2TextScaledWordEmbedding(vocab, dim, pad, embed_scale)`` takes no config, but the model
    holding it computes its ``embed_scale``); None where none does. Outermost first: a module in
    between may build from the config alone with a default that its parent passes otherwise
    (GPT-Neo's ``GPTNeoAttention(config, layer_id=0)`` is a global layer, the model's layer 1 local)."""
    parts = path.split(".") if path else []
    for depth in [len(parts), *range(len(parts))]:
        above = ".".join(parts[:depth])
        if above not in fresh:
            fresh[above] = rebuilt(source.get_submodule(above), configs_above(source, above))
        try:
            module = None if fresh[above] is None else fresh[above].get_submodule(".".join(parts[depth:]))
        except AttributeError:  # built from the config without that submodule
            continue
        value = None if module is None else module._buffers.get(attr)
        if value is not None and not value.is_meta and (expected is None or value.shape == expected.shape):
            return value
    return None


def configs_above(root: nn.Module, path: str) -> list[object]:
    """The ``config`` of the module at ``path`` and of each module above it, nearest first
    (transformers' ``BertEmbeddings`` keeps none; the ``BertModel`` holding it does)."""
    parts = path.split(".") if path else []
    configs: list[object] = []
    for depth in [len(parts), *range(len(parts))]:
        config = getattr(root.get_submodule(".".join(parts[:depth])), "config", None)
        if config is not None and all(config is not c for c in configs):
            configs.append(config)
    return configs


def rebuilt(module: nn.Module, configs: list[object]) -> nn.Module | None:
    """A fresh ``type(module)(config)`` with its parameters on meta, from the first config its
    constructor takes; None where none does."""
    for config in configs:
        try:
            with parameters_on_meta(), torch.device("cpu"):
                return type(module)(config)
        except Exception as e:  # noqa: BLE001 - a constructor of another signature: the error names the buffer
            log.debug("cannot rebuild %s from a config (%s)", type(module).__name__, e)
    return None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to ``meta`` (no memory); buffers stay where they are
    made (accelerate's ``init_empty_weights(include_buffers=False)``)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


__all__ = ["BuffersNotComputedError", "compute_buffers", "parameters_on_meta", "rebuilt", "rebuilt_buffer"]
