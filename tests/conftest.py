import pytest
import torch

from tests.distributed.harness import PoolCache
from tests.distributed.checks import reread_environment


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped cleanly without it")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on the CPU machine")
    config.addinivalue_line("markers", "cpu_ranks: rank bodies run over gloo on CPU even where GPUs are visible")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks():
    """ranks(n).run(body, *args) runs a module-level body on n ranks: gloo on CPU, NCCL on n GPUs,
    and gloo always in tests marked cpu_ranks (their bodies build CPU tensors)."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(scope="module", autouse=True)
def _module_rank_backend(request, ranks):
    # module scope too, so that module-scoped fixtures using `ranks` see a module's pytestmark
    ranks.backend = "gloo" if request.node.get_closest_marker("cpu_ranks") else None


@pytest.fixture(autouse=True)
def _test_rank_backend(request, ranks):
    saved = ranks.backend
    if request.node.get_closest_marker("cpu_ranks"):
        ranks.backend = "gloo"
    yield
    ranks.backend = saved


@pytest.fixture(autouse=True)
def _environment_read_afresh():
    """The settings tpflash reads from the environment once per process (TPFLASH_KERNELS,
    TPFLASH_COMM_BACKEND) re-read for each test, and after it (a test may set them with monkeypatch)."""
    reread_environment()
    yield
    reread_environment()
