"""What a spawned gloo rank imports, imported once by the fork server its ranks start from
(``tests.gloo_groups.rank_context``): torch's distributed, pipelining, FSDP and export modules,
dpcompile, and the transformers models the mesh tests build. Importing them in each rank cost
about 8-30 s of CPU per process; forked from a server that holds them, a rank starts in a
fraction of a second.

It also exports, once, the transformers programs that the ranks of several groups would each
export again (``export_for_ranks`` of ``test_exact_random_mesh.py`` and
``test_pipeline_mesh_compose.py``: about 2 s of CPU a model a rank, on 2 + 4 + 4 + 8 ranks; GPT-2 for
``test_export_mesh.py``'s export-frontend checks, on 2 ranks), on one
thread and with the generator's state put back, so that no thread pool is started and a rank
starts from the generator state it had without them. They go into ``tests.gloo_groups.CAPTURED``,
the one dict both this server and the ranks' checks see (see there why not a dict in the test file)."""

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
else:

    def _export_for_ranks() -> None:
        import warnings

        from tests.integration import test_exact_random_mesh, test_export_mesh, test_pipeline_mesh_compose

        threads = torch.get_num_threads()
        try:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.set_num_threads(1)
                test_exact_random_mesh.export_for_ranks()
                test_pipeline_mesh_compose.export_for_ranks()
                for seq in (test_export_mesh.GPT2_SEQ, test_export_mesh.GPT2_SEQ // 2):  # GPT-2 as the export
                    test_export_mesh._gpt2(seq)  # frontend captures it (whole sequences, a cp rank's), for 2 ranks
        except Exception:  # noqa: BLE001 - a rank then exports what is missing itself
            pass
        finally:
            torch.set_num_threads(threads)

    _export_for_ranks()
