import warnings

import pytest

import tpflash


@pytest.fixture
def single_process():
    """No default parallel state, and DCP's "assuming the intent is to save in a single process" quiet."""
    tpflash.parallel.set_default_state(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
