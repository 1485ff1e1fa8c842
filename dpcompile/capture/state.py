"""Tracing runs forward on stand-in values (fx proxies, export's fake tensors): what forward
stores in its modules' plain Python state while traced is no state of the model.

timm's attention-bias caches (LeViT, EfficientFormer: ``self.attention_bias_cache[device] =
...`` in eval) keep a traced value, which the next capture of the same model then reads as a
value of another graph (``Argument ... does not belong to this Graph``) and eager calls read as
a fake tensor. :func:`python_state_kept` gives every module back its attributes, and the
contents of its dicts and lists, as they were before tracing:

    with python_state_kept(model):
        graph = tracer.trace(model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

# nn.Module's own dicts (parameters, buffers, submodules, hooks): the tracers restore those themselves
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_FX_CONSTANTS = "_tensor_constant"  # torch.fx.Tracer.create_arg holds a tensor met while tracing on the root


@contextlib.contextmanager
def python_state_kept(model: nn.Module) -> Iterator[None]:
    saved = []
    for module in model.modules() if isinstance(model, nn.Module) else ():
        attributes = {k: v for k, v in module.__dict__.items() if k not in _MODULE_INTERNALS}
        contents = {k: (dict(v) if type(v) is dict else list(v)) for k, v in attributes.items() if type(v) in (dict, list)}
        saved.append((module, attributes, contents))
    try:
        yield
    finally:
        for module, attributes, contents in saved:
            state = module.__dict__
            for name in [k for k in state if k not in _MODULE_INTERNALS and k not in attributes]:
                if not name.startswith(_FX_CONSTANTS):  # fx's own: the graph reads them
                    del state[name]  # set while traced
            for name, value in attributes.items():
                if state.get(name) is not value:
                    state[name] = value
                if name in contents and _changed(value, contents[name]):
                    if type(value) is dict:
                        value.clear()
                        value.update(contents[name])
                    else:
                        value[:] = contents[name]


def _changed(value: dict | list, before: dict | list) -> bool:
    if len(value) != len(before):
        return True
    pairs = zip(value.values(), before.values()) if type(value) is dict else zip(value, before)
    return any(a is not b for a, b in pairs) or (type(value) is dict and list(value) != list(before))
