"""What a spawned gloo rank imports, imported once by the fork server its ranks start from
(``tests.gloo_groups.rank_context``): torch's distributed, pipelining, FSDP and export modules,
dpcompile, and the transformers models the mesh tests build. Importing them in each rank cost
about 8-30 s of CPU per process; forked from a server that holds them, a rank starts in a
fraction of a second.

It also prepares, in the server and once, what a group's ranks would each do again: a group asks
with ``run_spawned(prepare=["module:function", ...])`` (e.g. ``export_for_ranks`` of
``test_exact_random_mesh.py``: it exports GPT-2, BERT and ViT, about 2 s of CPU a model a rank),
and just before the server forks that group's first rank it calls each function it has not called
yet. The exports go into ``tests.gloo_groups.CAPTURED``, the one dict both this server and the
ranks' checks see (see there why not a dict in the test file). Done there, not here at import: a
test process whose groups need none of them (most) no longer pays about 10 s of CPU for them.
Each runs on one thread and with the generator's state put back, so that no thread pool is
started and a rank starts from the generator state it had without them."""

import json
import os

import torch
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401
import torch.export._trace  # noqa: F401 - what an export imports on first use (0.1 CPU-s), for every rank that exports
from torch._functorch import aot_autograd  # noqa: F401

import dpcompile  # noqa: F401
import tests.gloo_groups  # noqa: F401

try:  # optional: the tests that need transformers skip without it
    from tests.thirdparty import define_torchvision_ops

    define_torchvision_ops()
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
except Exception:  # noqa: BLE001 - a rank that needs it imports it itself and reports the error
    pass

_SERVER_PID = os.getpid()
_PREPARED: set[str] = set()


def _prepare_what_the_next_ranks_ask() -> None:
    """``os.register_at_fork(before=...)``: in the fork server only (a rank that forks inherits the
    hook), call each ``module:function`` the test process's request file names (written around
    ``run_spawned``'s starts) that this server has not called yet."""
    if os.getpid() != _SERVER_PID:
        return
    try:
        with open(os.environ[tests.gloo_groups.PREPARE_REQUESTS_ENV]) as f:
            names = [name for name in json.load(f) if name not in _PREPARED]
    except (KeyError, OSError, ValueError):
        return
    for name in names:
        _PREPARED.add(name)
        _call_on_one_thread(name)


def _call_on_one_thread(name: str) -> None:
    import importlib
    import warnings

    threads = torch.get_num_threads()
    module, function = name.split(":")
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.set_num_threads(1)
            getattr(importlib.import_module(module), function)()
    except Exception:  # noqa: BLE001 - a rank then captures what is missing itself (and a check can say so)
        pass
    finally:
        torch.set_num_threads(threads)


os.register_at_fork(before=_prepare_what_the_next_ranks_ask)
