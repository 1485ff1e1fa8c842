import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("deep", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _threads_per_xdist_worker() -> int | None:
    """The cores each xdist worker may use (its share of this process's cores), or None outside xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# Under -n 2 on 2 cores, each worker's default intra-op pool (one thread a core) oversubscribes the
# cores and its OpenMP threads spin while waiting: a worker gets its share instead (measured: the same
# tests took 23 user-seconds on 1 thread against 48-68 on 2 with another process busy). Tests compare
# against eager in the same process, so the thread count changes no expectation.
if (_threads := _threads_per_xdist_worker()) is not None:
    torch.set_num_threads(_threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process, destroyed afterwards (a check it deferred
    settled first)."""
    import torch.distributed as dist

    from dpcompile.runtime import distributed

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        distributed.settle_deferred_check()
        dist.destroy_process_group()
