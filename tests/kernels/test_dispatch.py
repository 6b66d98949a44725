"""The backend dispatcher: auto picks the reference on CPU; use_backend and TPFLASH_KERNELS override."""
import pytest
import torch

from tpflash.kernels import dispatch, use_backend


def test_auto_picks_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("TPFLASH_KERNELS", raising=False)
    assert dispatch.pick(torch.zeros(1)) == "reference"


def test_use_backend_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("TPFLASH_KERNELS", "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"):
        assert dispatch.pick(torch.zeros(1)) == "triton"
    assert dispatch.pick(torch.zeros(1)) == "reference"


def test_forcing_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET is not set"):
        dispatch.pick(torch.zeros(1))


def test_unknown_backend_names_are_rejected(monkeypatch):
    monkeypatch.setenv("TPFLASH_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"TPFLASH_KERNELS='cuda' must be one of"):
        dispatch.requested_backend()


def test_without_triton_auto_runs_the_reference_and_forcing_triton_says_why(monkeypatch):
    monkeypatch.delenv("TPFLASH_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert dispatch.pick(torch.zeros(1)) == "reference"
    with use_backend("triton"), pytest.raises(ValueError, match="Triton is not installed"):
        dispatch.pick(torch.zeros(1))


def test_use_backend_reaches_other_threads_such_as_autograds_device_thread(monkeypatch):
    """A CUDA backward runs on autograd's own thread: it must see the backend forced around it."""
    import threading
    monkeypatch.delenv("TPFLASH_KERNELS", raising=False)
    seen = []
    with use_backend("reference"):
        worker = threading.Thread(target=lambda: seen.append(dispatch.requested_backend()))
        worker.start()
        worker.join()
    assert seen == ["reference"]
    assert dispatch.requested_backend() == "auto"
