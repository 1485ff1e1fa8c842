"""Capture a model as a ``torch.fx`` graph: two frontends and one error type.

* :mod:`~dpcompile.capture.fx`: ``torch.fx`` symbolic tracing (module calls stay calls);
* :mod:`~dpcompile.capture.export`: ``torch.export`` (non-strict), for code fx cannot trace
  (shape and dtype branches, wrapped forwards such as transformers 5.x);
* :func:`capture_model` chooses between them (``frontend="fx" | "export" | "auto"``);
* :mod:`~dpcompile.capture.errors`: every failure is a :class:`~dpcompile.TraceError` naming
  the user's file and line and the way out.
"""

from dpcompile.capture.errors import check_examples, check_signature, trace_error
from dpcompile.capture.fx import (
    FLAG_TYPES,
    ROOT_LEAF,
    DpTracer,
    bind_examples,
    capture,
    capture_fx,
    flag_arguments,
    forward_parameters,
    optional_arguments,
)

__all__ = [
    "FLAG_TYPES",
    "ROOT_LEAF",
    "DpTracer",
    "bind_examples",
    "check_examples",
    "check_signature",
    "capture",
    "capture_fx",
    "flag_arguments",
    "forward_parameters",
    "optional_arguments",
    "trace_error",
]

from dpcompile.capture.frontend import (  # noqa: E402
    EXPORTED_FROM,
    FRONTENDS,
    CaptureInfo,
    capture_model,
    check_frontend,
    positional_examples,
)

__all__ += ["EXPORTED_FROM", "FRONTENDS", "CaptureInfo", "capture_model", "check_frontend", "positional_examples"]
