"""The closed vocabulary of a loaded program: every function it may call, by exact name.

A loaded program names what it calls (``torch.relu``, ``torch.ops.aten.add.Tensor``,
``dpcompile.runtime.scatter``); :func:`vocabulary` is the one table those names are looked
up in, built once (the first time a folder is written or read) and frozen. Nothing in it
resolves a name later: a name that is not a key is refused, so no chain of attribute reads
(``aten_op("__class__", "__init__", "__globals__")``) can reach a function that is not listed.

=================================  ==========================================================
``torch.ops.aten.<op>.<overload>``  ATen overloads: the core opset (``torch.Tag.core``), every
                                   op the ``torch.X`` / ``torch.nn.functional`` / ``Tensor.X``
                                   entries below call, the Python operators on tensors
                                   (``aten.__and__.Tensor``) and what the ``torch.export``
                                   frontend emits besides (``_assert_tensor_metadata``, ...)
``torch.<name>``                   torch's native functions and ``torch.functional``
``torch.nn.functional.<name>``     the functional API; ``torch._C._nn.<name>`` its natives
``torch._C._fft.<name>``           ``torch.fft``'s functions (``fft_fftn``); ``torch._C._linalg``: ``torch.linalg``'s
``torch.Tensor.<name>``            the Tensor methods of :data:`TENSOR_METHODS`
``operator.<name>``, ``math.<name>``, ``builtins.<name>``   fixed lists below
``dpcompile.runtime...``           the functions generated code calls
=================================  ==========================================================

Never on it, whatever namespace they are in (:data:`DENIED`): what reads or writes files,
processes, sockets or memory by address (``from_file``, ``save``, ``load``, ``numpy``,
``data_ptr``, ``untyped_storage``, ``set_``, ...), what runs a callable it is given
(``apply_``, ``register_hook``), what changes global state (``manual_seed``,
``set_default_dtype``), dunders other than the Python operators, and ``out=`` overloads.

>>> vocabulary()["torch.ops.aten.add.Tensor"] is torch.ops.aten.add.Tensor
True
>>> "torch.ops.aten.from_file.default" in vocabulary(), "torch.Tensor.numpy" in vocabulary()
(False, False)
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx._symbolic_trace import _assert_is_none

__all__ = ["DENIED", "GETATTR_NAMES", "TENSOR_METHODS", "denied", "vocabulary"]

# What a program never calls, in any namespace: files, processes, sockets, memory by address,
# callables run on its behalf, global state. Checked by name: ``torch.save``, ``aten.save``,
# ``Tensor.numpy`` and ``F.numpy`` alike.
DENIED = frozenset(
    {"from_file", "save", "load", "tofile", "numpy", "from_numpy", "frombuffer", "from_dlpack", "to_dlpack",
     "asarray", "data_ptr", "const_data_ptr", "untyped_storage", "storage", "storage_type", "set_", "is_set_to",
     "share_memory_", "is_shared", "pin_memory", "is_pinned", "record_stream", "new", "resize", "resize_",
     "resize_as", "resize_as_", "resize_as_sparse_", "sparse_resize_", "sparse_resize_and_clear_",
     "apply_", "map_", "map2_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
     "backward", "reinforce", "module_load", "as_subclass", "warn", "manual_seed", "seed", "initial_seed",
     "set_rng_state", "get_rng_state", "set_num_threads", "set_num_interop_threads", "set_default_dtype",
     "set_default_device", "set_default_tensor_type", "set_printoptions", "set_flush_denormal",
     "use_deterministic_algorithms", "set_warn_always", "compile", "set_grad_enabled", "set_autocast_enabled"}
)  # fmt: skip
# words in an argument name that mean a path on disk (``aten::save(..., str filename)``)
_PATH_ARGUMENTS = ("file", "path", "dir")

# Tensor methods defined in Python (the native ones come from ``torch._C.TensorBase``)
_PYTHON_TENSOR_METHODS = frozenset(
    {"detach", "detach_", "dim_order", "istft", "lu", "norm", "split", "stft", "to_sparse_coo", "unflatten",
     "unique", "unique_consecutive", "refine_names", "align_to", "rename", "rename_"}
)  # fmt: skip
# Python operators on tensors, as ATen ops (``mask_a & mask_b`` is ``aten.__and__.Tensor``)
_OPERATOR_OPS = frozenset(
    {"__and__", "__or__", "__xor__", "__lshift__", "__rshift__", "__iand__", "__ior__", "__ixor__",
     "__ilshift__", "__irshift__"}
)  # fmt: skip
# what the torch.export frontend emits that is not core and no torch.X / Tensor.X function (the views
# ``x.T``, ``x.mT``, ``x.H``, ``x.mH`` are ``aten.numpy_T`` and kin: attributes, not methods)
_FRONTEND_OPS = frozenset(
    {"_assert_tensor_metadata", "_assert_scalar", "_assert_async", "_functional_assert_async",
     "_functional_assert_scalar", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
     "_local_scalar_dense", "_to_copy", "_softmax", "_log_softmax", "_unsafe_view", "alias", "lift_fresh_copy",
     "native_layer_norm", "native_dropout", "_native_batch_norm_legit_no_training",
     "_native_batch_norm_legit_functional", "_unsafe_index", "_safe_softmax", "scaled_dot_product_attention",
     "linear", "cross_entropy_loss", "nll_loss_nd", "pad", "_scaled_dot_product_flash_attention_for_cpu",
     "_scaled_dot_product_efficient_attention", "numpy_T", "matrix_H", "mT", "mH"}
)  # fmt: skip
_OPERATORS = frozenset(
    {"getitem", "setitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos",
     "invert", "and_", "or_", "xor", "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge", "not_", "is_",
     "is_not", "contains", "abs", "index", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
     "imatmul", "iand", "ior", "ixor", "truth", "concat"}
)  # fmt: skip
# ``getattr`` is checked apart: its name is one of GETATTR_NAMES or a child module (see the checker)
_BUILTINS = frozenset(
    {"getattr", "len", "int", "float", "bool", "min", "max", "abs", "tuple", "list", "slice", "range", "round",
     "sum", "all", "any", "pow", "divmod"}
)  # fmt: skip
_MATH = frozenset(
    {"sqrt", "log", "log2", "log10", "log1p", "exp", "expm1", "ceil", "floor", "trunc", "fabs", "pow", "sin",
     "cos", "tan", "tanh", "erf", "erfc", "gcd", "isinf", "isnan", "isfinite", "prod", "fsum", "copysign", "fmod", "hypot", "atan", "atan2", "asin", "acos", "sinh", "cosh", "gamma",
     "lgamma", "comb", "perm", "isqrt", "factorial", "radians", "degrees", "lcm", "remainder"}
)  # fmt: skip
# the runtime modules generated code calls (not the SPMD ones: an SPMD program is not exported)
RUNTIME_MODULES = (
    "dpcompile.runtime",
    "dpcompile.runtime.comm",
    "dpcompile.runtime.reduce",
    "dpcompile.runtime.replicate",
    "dpcompile.runtime.rnn",
    "dpcompile.runtime.batchnorm",
    "dpcompile.runtime.tensor_parallel",
    "dpcompile.runtime.collectives",
    "dpcompile.runtime.exported",
)
# runtime functions that are not for programs: op lookup (pickling), the replica cache
_RUNTIME_DENIED = frozenset({"aten_op", "refresh_replicas"})
# Attributes ``getattr(value, name)`` may read of a value that is not a module: tensor data,
# never a method (a bound method in hand is a call the vocabulary does not list)
GETATTR_NAMES = frozenset(
    {"shape", "dtype", "device", "ndim", "T", "mT", "H", "mH", "real", "imag", "layout", "requires_grad",
     "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_leaf", "itemsize", "nbytes",
     "names", "data", "training"}
)  # fmt: skip


def denied(name: str) -> bool:
    """A name no program calls: on :data:`DENIED`, or a dunder that is not a Python operator."""
    return name in DENIED or (name.startswith("__") and name not in _OPERATOR_OPS)


def _native_tensor_methods() -> frozenset[str]:
    base = torch._C.TensorBase
    return frozenset(n for n in dir(base) if not n.startswith("_") and callable(getattr(base, n, None)))


TENSOR_METHODS = frozenset(
    n
    for n in _native_tensor_methods() | _PYTHON_TENSOR_METHODS
    if not denied(n) and callable(getattr(torch.Tensor, n, None))
)
"""The ``call_method`` names a program may use, on a value that is not a module: Tensor methods."""


def _aten_names(packet_names: set[str]) -> dict[str, Any]:
    """``torch.ops.aten.<op>.<overload>`` for the named packets' overloads and every core overload,
    keeping those that take or return a tensor, write no ``out=`` and name no path."""
    table: dict[str, Any] = {}
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        op, _, overload = full[len("aten::") :].partition(".")
        if denied(op) or (op.startswith("_") and op not in packet_names and not op.startswith("__")):
            continue
        try:
            found = torch._C._get_operation_overload(f"aten::{op}", overload)
        except RuntimeError:
            continue
        if found is None or (op not in packet_names and torch.Tag.core not in found[2]):
            continue
        schema = torch._C._get_schema(f"aten::{op}", overload)
        arguments = list(schema.arguments)
        if any(a.is_out for a in arguments) or any(_names_a_path(a) for a in arguments):
            continue
        types_ = [str(a.type) for a in arguments] + [str(r.type) for r in schema.returns]
        if not any("Tensor" in t for t in types_) and op not in _FRONTEND_OPS:  # _assert_scalar(Scalar, str) stays
            continue  # TorchScript's list, dict and string ops
        try:
            obj = getattr(getattr(torch.ops.aten, op), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if isinstance(obj, torch._ops.OpOverload):
            table[f"torch.ops.aten.{op}.{overload or 'default'}"] = obj
    return table


def _names_a_path(argument: Any) -> bool:
    """A string argument whose name says it is a path (``filename``), not ``bidirectional``."""
    return str(argument.type).rstrip("?") == "str" and any(w in argument.name.lower() for w in _PATH_ARGUMENTS)


def _public(namespace: Any, names: Any, *, defined_in: str | None = None) -> dict[str, Any]:
    out = {}
    for name in names:
        if name.startswith("_") or denied(name):
            continue
        obj = getattr(namespace, name, None)
        if not callable(obj) or isinstance(obj, type):
            continue
        native = obj is getattr(torch._C._VariableFunctions, name, None) or obj is getattr(torch._C._nn, name, None)
        if defined_in is None or native or getattr(obj, "__module__", None) == defined_in:
            out[name] = obj
    return out


def _runtime_functions() -> dict[str, Any]:
    import importlib

    out: dict[str, Any] = {}
    for module_name in RUNTIME_MODULES:
        module = importlib.import_module(module_name)  # dpcompile's own, fixed list
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if name in _RUNTIME_DENIED or isinstance(obj, type) or not callable(obj):
                continue
            if (getattr(obj, "__module__", "") or "").startswith("dpcompile.runtime"):
                out[f"{module_name}.{name}"] = obj
    return out


@functools.cache
def vocabulary() -> Mapping[str, Callable[..., Any]]:
    """Every function a loaded program may call, by the qualified name ``program.json`` holds:
    a read-only mapping, built once."""
    torch_functions = _public(torch._C._VariableFunctions, dir(torch._C._VariableFunctions))
    torch_functions = {n: getattr(torch, n) for n in torch_functions if getattr(torch, n, None) is torch_functions[n]}
    torch_functions.update(_public(torch.functional, torch.functional.__all__))
    functional = _public(F, dir(F), defined_in="torch.nn.functional")
    nn_natives = _public(torch._C._nn, dir(torch._C._nn))
    fft_natives = _public(torch._C._fft, dir(torch._C._fft))  # torch.fft.fftn (FNet's token mixing)
    linalg_natives = _public(torch._C._linalg, dir(torch._C._linalg))  # torch.linalg.vector_norm (SigLIP)
    methods = {n: getattr(torch.Tensor, n) for n in TENSOR_METHODS}
    packets = (
        set(torch_functions) | set(nn_natives) | set(functional) | set(TENSOR_METHODS) | _OPERATOR_OPS | _FRONTEND_OPS
        | set(fft_natives) | set(linalg_natives)
    )
    table: dict[str, Any] = _aten_names(packets)
    table.update({f"torch.{n}": f for n, f in torch_functions.items()})
    table["torch._assert"] = torch._assert
    table.update({f"torch.functional.{n}": f for n, f in _public(torch.functional, torch.functional.__all__).items()})
    table.update({f"torch.nn.functional.{n}": f for n, f in functional.items()})
    table.update({f"torch._C._nn.{n}": f for n, f in nn_natives.items()})
    table.update({f"torch._C._fft.{n}": f for n, f in fft_natives.items()})
    table.update({f"torch._C._linalg.{n}": f for n, f in linalg_natives.items()})
    table.update({f"torch.Tensor.{n}": f for n, f in methods.items()})
    table.update({f"operator.{n}": getattr(operator, n) for n in _OPERATORS})
    table.update({f"builtins.{n}": getattr(builtins, n) for n in _BUILTINS})
    table.update({f"math.{n}": getattr(math, n) for n in _MATH if hasattr(math, n)})
    table["torch.fx._symbolic_trace._assert_is_none"] = _assert_is_none  # an optional argument traced as None
    table.update(_runtime_functions())  # imports dpcompile.runtime, which registers dpcompile's ops
    table["torch.ops.dpcompile.encoder_nested_path.default"] = torch.ops.dpcompile.encoder_nested_path.default
    return types.MappingProxyType(table)
