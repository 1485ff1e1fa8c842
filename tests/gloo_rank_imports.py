"""What a spawned gloo rank imports, imported once by the fork server its ranks start from
(``tests.gloo_groups.rank_context``): torch's distributed, pipelining, FSDP and export modules,
dpcompile, and the transformers models the mesh tests build. Importing them in each rank cost
about 8-30 s of CPU per process; forked from a server that holds them, a rank starts in a
fraction of a second. Nothing here runs a tensor op or starts a thread pool."""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401

import dpcompile  # noqa: F401
import tests.gloo_groups  # noqa: F401

try:  # optional: the tests that need transformers skip without it
    from tests.thirdparty import define_torchvision_ops

    define_torchvision_ops()
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
except Exception:  # noqa: BLE001 - a rank that needs it imports it itself and reports the error
    pass
