"""gemm_workspace: which cuBLAS workspace each setting asks for, and that the user's own value is kept."""
import pytest
import torch

from tpflash.kernels import gemm_workspace
from tpflash.kernels.gemm_workspace import ENV, NO_WORKSPACE, apply, choose


@pytest.fixture
def deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_auto_asks_for_no_workspace_above_one_tp_rank_and_leaves_tp1_alone():
    assert choose("auto", 2, environ={}) == NO_WORKSPACE
    assert choose("auto", 4, environ={}) == NO_WORKSPACE
    assert choose("auto", 1, environ={}) is None


def test_default_leaves_the_environment_and_none_asks_for_no_workspace_at_any_tp():
    assert choose("default", 4, environ={}) is None
    assert choose("none", 1, environ={}) == NO_WORKSPACE


def test_a_workspace_the_environment_already_sets_is_kept():
    assert choose("auto", 2, environ={ENV: ":4096:8"}) is None
    assert choose("none", 2, environ={ENV: NO_WORKSPACE}) is None


def test_none_against_another_environment_value_names_both():
    with pytest.raises(ValueError, match=r"gemm_workspace='none' conflicts with CUBLAS_WORKSPACE_CONFIG=':4096:8'"):
        choose("none", 2, environ={ENV: ":4096:8"})


def test_an_unknown_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"gemm_workspace='small' must be one of \('auto', 'default', 'none'\)"):
        choose("small", 2, environ={})


def test_auto_keeps_the_default_under_deterministic_algorithms_and_none_refuses_them(deterministic_algorithms):
    assert choose("auto", 2, environ={}) is None
    with pytest.raises(ValueError, match="use_deterministic_algorithms"):
        choose("none", 2, environ={})


def _without_env(monkeypatch):
    monkeypatch.setenv(ENV, "")  # recorded, so that the teardown restores the process's own value (or none)
    monkeypatch.delenv(ENV)


def test_apply_sets_the_environment_on_cuda_and_reports_it(monkeypatch):
    _without_env(monkeypatch)
    assert apply("auto", 2, on_cuda=True) == "none"
    assert gemm_workspace.os.environ[ENV] == NO_WORKSPACE
    monkeypatch.setenv(ENV, ":16:8")
    assert apply("auto", 2, on_cuda=True) == f"{ENV}=:16:8"


def test_apply_off_cuda_checks_the_setting_and_touches_nothing(monkeypatch):
    _without_env(monkeypatch)
    assert apply("auto", 2, on_cuda=False) is None
    assert ENV not in gemm_workspace.os.environ
    with pytest.raises(ValueError, match="must be one of"):
        apply("small", 2, on_cuda=False)


def test_apply_warns_where_cuda_may_have_run_a_gemm_already(monkeypatch):
    _without_env(monkeypatch)
    monkeypatch.setattr(gemm_workspace.torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set"):
        assert apply("auto", 2, on_cuda=True) == "none"
