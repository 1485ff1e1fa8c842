"""The model's own hooks, which tracing ``model.forward`` never records, run around a program as
``model(x)`` runs them: forward pre-hooks and hooks, backward hooks and pre-hooks, and the
``state_dict`` hooks of the model itself (a data-parallel program shares the model's submodules,
so theirs run as they are).

    output = call_with_hooks(model, program, args, kwargs)   # model.__call__ with program as forward

And the refusals where a hook or a change cannot be followed: backward hooks on a module forward
is traced through, and changes to a tensor-parallel program's own submodules.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import BackwardHook

from dpcompile.errors import DpCompileError
from dpcompile.runtime.side_effects import assign_buffer, attributes_written_by, set_attributes, take_root_writes

_GLOBAL_HOOKS = tuple(
    getattr(nn_module, name)
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
)


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module.__call__`` would do more than call ``forward`` (as ``nn.Module._call_impl`` checks)."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or any(_GLOBAL_HOOKS)
    )  # fmt: skip


def call_with_hooks(model: nn.Module, run: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``run`` as ``model.__call__`` would run ``model.forward``: the model's own forward
    pre-hooks and hooks around it, and its backward hooks on the gradients of its inputs and
    outputs (global hooks run in ``run``'s own call)."""
    for hook_id, hook in list(model._forward_pre_hooks.items()):
        if hook_id in model._forward_pre_hooks_with_kwargs:
            result = hook(model, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(model, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    backward = None
    full_hooks = list(model._backward_hooks.values()) if model._is_full_backward_hook is True else []
    if full_hooks or model._backward_pre_hooks:
        backward = BackwardHook(model, full_hooks, list(model._backward_pre_hooks.values()))
        args = backward.setup_input_hook(args)
    output = run(*args, **kwargs)
    for hook_id, hook in list(model._forward_hooks.items()):
        if hook_id in model._forward_hooks_with_kwargs:
            result = hook(model, args, kwargs, output)
        else:
            result = hook(model, args, output)
        if result is not None:
            output = result
    if backward is not None:
        output = backward.setup_output_hook(output)
    if model._backward_hooks and model._is_full_backward_hook is False:  # register_backward_hook (deprecated)
        _register_module_backward_hooks(model, output)
    return output


def run_as_model(pm: Any, program: Any, args: tuple, kwargs: dict, call: Any) -> Any:
    """Run ``program`` as the model would run: the model's own forward hooks around it, which
    tracing forward never records (``call``: ``pm``'s own ``nn.Module.__call__``, which runs hooks
    the user registered on ``pm``); then what forward writes to the model itself (see
    :func:`run_writing_to_model`)."""

    def run() -> Any:
        if pm._shares_source and pm._guard.root_hooks():
            return call_with_hooks(pm.traced_model, call if program is pm else program, args, kwargs)
        if program is pm:
            return call(*args, **kwargs) if has_hooks(pm) else pm.forward(*args, **kwargs)
        return program(*args, **kwargs)

    return run_writing_to_model(pm, program, run)


def run_writing_to_model(pm: Any, program: Any, run: Any) -> Any:
    """``run()`` (a call of ``program``, in whatever order its executor runs it), then what forward
    writes to the model itself, which the graph has no name for: the plain attributes it sets
    (``self.rescaled = True``) and the buffers it rebinds (:mod:`dpcompile.runtime.side_effects`)."""
    take_root_writes()  # none left from a call that failed
    writes = program.__dict__.get("_attributes_written")
    if writes is None:
        writes = program.__dict__["_attributes_written"] = attributes_written_by(program.graph)
    output = run()
    rebound = take_root_writes()
    if writes or rebound:
        model = pm.traced_model if pm._shares_source and pm.traced_model is not None else pm
        set_attributes(model, writes)
        for name, value in rebound:
            assign_buffer(model, name, value)
    return output


def _register_module_backward_hooks(model: nn.Module, output: Any) -> None:
    var = output
    while not hasattr(var, "grad_fn"):
        var = next(iter(var.values())) if isinstance(var, dict) else var[0]
    if var.grad_fn is not None:
        for hook in model._backward_hooks.values():
            var.grad_fn.register_hook(nn_module._WrappedHook(hook, model))


def state_dict_with_hooks(model: nn.Module, save: Any, prefix: str, keep_vars: bool) -> Any:
    """``save()`` (the program's state dict, the model's keys) with the model's own
    ``state_dict`` pre-hooks and post-hooks around it, as ``model.state_dict()`` runs them."""
    for hook in model._state_dict_pre_hooks.values():
        hook(model, prefix, keep_vars)
    destination = save()
    metadata = getattr(destination, "_metadata", {}).get(prefix[:-1], {"version": model._version})
    for hook in model._state_dict_hooks.values():
        result = hook(model, destination, prefix, metadata)
        if result is not None and not getattr(hook, "_from_public_api", False):
            destination = result
    return destination


def load_pre_hooks(model: nn.Module, state_dict: Any, prefix: str, *rest: Any) -> None:
    """Run the model's own ``load_state_dict`` pre-hooks (they may rename or convert entries)."""
    for hook in model._load_state_dict_pre_hooks.values():
        hook(state_dict, prefix, *rest)


def backward_hooks_error(model: nn.Module, paths: list[str]) -> DpCompileError:
    """The error for backward hooks on modules forward is traced through (``paths``)."""
    first = model.get_submodule(paths[0])
    return DpCompileError(
        f"backward hooks on {', '.join(repr(p) for p in paths[:3])} (a module forward is traced through, "
        "not called) cannot run in the generated program, and the program would silently skip them. "
        f"Mark the module as a leaf (leaf_modules=[{type(first).__name__}]) so it is called with its hooks, "
        "register the hook on the model itself or on a tensor (tensor.register_hook), or remove it."
    )


def check_unchanged_since_transform(guard: Any, hooks: tuple, attributes: tuple) -> None:
    """A tensor-parallel program traced a private copy of the model: a submodule, hook or attribute
    forward reads, changed on the program's own submodules since (``guard`` watches them; ``hooks``
    and ``attributes`` are what it saw at transform), cannot be followed, so it is refused."""
    if [p for p, _ in guard.hooks] != [p for p, _ in hooks]:
        raise DpCompileError(
            "a submodule forward is traced through was replaced or removed on this tensor-parallel program "
            "after transform; change the model and call dpcompile.transform again"
        )
    if guard.hooks != hooks:
        raise DpCompileError(
            "a forward or backward hook was added to or removed from a submodule of this tensor-parallel "
            "program after transform; hooks of modules forward is traced through are part of the program. "
            "Register them on the model before dpcompile.transform (or on the program itself, pm.register_forward_hook)."
        )
    if guard.attributes != attributes:
        before, now = ({(p, n): v for p, pairs in attrs for n, v in pairs} for attrs in (attributes, guard.attributes))
        changed = sorted(f"{p}.{n}".lstrip(".") for p, n in before.keys() | now.keys() if before.get((p, n)) != now.get((p, n)))
        raise DpCompileError(
            f"attributes forward reads ({', '.join(changed[:4])}) changed on this tensor-parallel program's "
            "submodules after transform; the program was traced with their old values. Set them on the model "
            "and call dpcompile.transform again."
        )


def _written_buffer(node: Any, model: nn.Module) -> bool:
    """Whether an ``in_place_without_grad`` node writes into a buffer of ``model`` (through a chain
    of such writes: ``self.avg.mul_(0.9).add_(m)``), not a parameter or a value."""
    from dpcompile.runtime.side_effects import in_place_without_grad

    while getattr(node, "op", None) == "call_function" and node.target is in_place_without_grad:
        node = node.args[0]
    if getattr(node, "op", None) != "get_attr":
        return False
    owner, _, name = str(node.target).rpartition(".")
    try:
        return name in model.get_submodule(owner)._buffers
    except AttributeError:
        return False


def adopt_root_hooks(pm: nn.Module, model: nn.Module) -> None:
    """A program that traced a private copy of the model (tensor parallel) takes the model's own
    forward hooks and pre-hooks, which tracing forward never records, so that its call runs them
    around the program as the model's call runs them around forward (they receive ``pm``); a
    backward hook on the model itself is refused by name."""
    if model._backward_hooks or model._backward_pre_hooks:
        raise DpCompileError(
            f"{type(model).__name__} has a backward hook on itself, which a tensor-parallel program (its own sharded "
            "parameters) does not run; register it on the program after transform (pm.register_full_backward_hook)"
        )
    pm._forward_pre_hooks.update(model._forward_pre_hooks)
    pm._forward_pre_hooks_with_kwargs.update(model._forward_pre_hooks_with_kwargs)
    pm._forward_hooks.update(model._forward_hooks)
    pm._forward_hooks_with_kwargs.update(model._forward_hooks_with_kwargs)
    pm._forward_hooks_always_called.update(model._forward_hooks_always_called)


def refuse_writes_of_a_private_copy(graph: Any, model: nn.Module) -> None:
    """A tensor-parallel program traced a private copy of the model and owns sharded parameters:
    what forward writes to the model (a flag, an in-place update inside ``no_grad``) would land on
    the copy or on one shard, so it is refused at transform, by name (buffers forward writes are
    the program's own: they are written as in data parallel)."""
    from dpcompile.runtime.side_effects import attributes_written, in_place_without_grad

    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (attributes_written, in_place_without_grad):
            continue
        if node.target is in_place_without_grad and _written_buffer(node, model):
            continue  # an EMA buffer updated under no_grad: the program's own buffer, written as outside no_grad
        if node.target is attributes_written:
            what = ", ".join(f"{p}.{n}".lstrip(".") for p, values in node.args[0].items() for n in values)
            what = f"sets {what}"
        else:
            what = f"updates {getattr(node.args[0], 'target', node.args[0])!s} in place ({node.args[1]})"
        where = (node.meta.get("stack_trace") or "").strip().splitlines()
        raise DpCompileError(
            f"{type(model).__name__}.forward {what}{' (' + where[0].strip() + ')' if where else ''}: a tensor-parallel "
            "program owns sharded copies of the model's state and cannot replay that write as eager does. Do the "
            "one-time work before dpcompile.transform, or use data parallelism (tensor_parallel=False)."
        )
