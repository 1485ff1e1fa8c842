"""Ship a :class:`~dpcompile.ParallelModule` as a folder, and load it back in another process.

``export(pm, folder)`` writes (``docs/export.md`` has the details):

=======================  ===============================================================
``module.py``            the generated code, readable: every program of ``program.json``
                         (variants and the programs before lowering included); never
                         run by ``load``, which regenerates it and refuses a difference
``program.json``         the program as data: graphs (one per variant: train/eval,
                         optional arguments left None), module tree, settings, tensors
``weights.safetensors``  every parameter and buffer (tensor-parallel shards as they are)
``manifest.json``        format version, a summary, and each file's size and sha256
``program.pkl``          only for programs holding Python classes fx kept as leaves;
                         read only by ``load(path, trust_code=True)``
=======================  ===============================================================

``load(folder, devices=None)`` checks everything before it builds anything, executes no
code and unpickles nothing from the folder, and returns a ``ParallelModule`` of the kind
the folder records, on the exported devices or others (data parallel: any number).

>>> import torch, dpcompile
>>> pm = dpcompile.transform(torch.nn.Linear(4, 2), ["cpu", "cpu"])
>>> folder = dpcompile.export(pm, "/tmp/linear_export")  # doctest: +SKIP
>>> again = dpcompile.load(folder)  # doctest: +SKIP
"""

from dpcompile.export.allowlist import register_module_class, register_output_type
from dpcompile.export.common import FORMAT, FORMAT_VERSION, ExportError
from dpcompile.export.folder import export, load
from dpcompile.export.integrity import manifest_hash, read_manifest
from dpcompile.export.source import generated_source

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ExportError",
    "export",
    "generated_source",
    "load",
    "manifest_hash",
    "read_manifest",
    "register_module_class",
    "register_output_type",
]
