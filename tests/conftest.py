import os

import pytest
import torch

from tests.distributed.harness import PoolCache


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped cleanly without it")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on the CPU machine")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks():
    """ranks(n).run(body, *args) runs a module-level body on n ranks (gloo on CPU, NCCL on n GPUs)."""
    cache = PoolCache()
    yield cache
    cache.close()
