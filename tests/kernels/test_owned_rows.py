"""copy_owned_rows: the rows whose ids lie in [lo, hi) copied (from a table or in place), the others
left alone or zeroed; the Triton kernel moves exactly the reference's rows."""
import pytest
import torch

from tests.kernels.helpers import needs_interpreter
from tpflash.kernels import use_backend
from tpflash.kernels.owned_rows import ZERO_INVALID, ZERO_NONE, ZERO_UNOWNED, copy_owned_rows

LO, HI, VALID_HI = 5, 12, 20  # this rank owns ids 5..11 of a padded vocabulary of 20


def _case(n, dim, lookup, device="cpu"):
    g = torch.Generator().manual_seed(n * 100 + dim)
    ids = torch.randint(-2, VALID_HI + 3, (n,), generator=g)  # owned, others' and invalid ids
    src = torch.randn(HI - LO if lookup else n, dim, generator=g)
    dst = torch.full((n, dim), 7.0)  # rows left alone keep their 7s
    return ids.to(device), src.to(device), dst.to(device)


def _spelled_out(ids, src, dst, lookup, zero):
    """The rule, one row at a time."""
    out = dst.clone()
    for i, t in enumerate(ids.tolist()):
        if LO <= t < HI:
            out[i] = src[t - LO] if lookup else src[i]
        elif zero == ZERO_UNOWNED or (zero == ZERO_INVALID and not 0 <= t < VALID_HI):
            out[i] = 0
    return out


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("lookup", [True, False])
@pytest.mark.parametrize("zero", [ZERO_NONE, ZERO_INVALID, ZERO_UNOWNED])
@pytest.mark.parametrize("n,dim", [(1, 3), (37, 20)])
def test_the_owned_rows_are_copied_and_the_rest_left_or_zeroed_by_rule(backend, lookup, zero, n, dim):
    ids, src, dst = _case(n, dim, lookup)
    expected = _spelled_out(ids, src, dst, lookup, zero)
    with use_backend(backend):
        copy_owned_rows(ids, src, dst, LO, HI, lookup=lookup, zero=zero, valid_hi=VALID_HI)
    assert torch.equal(dst, expected)


def test_a_table_shard_of_the_wrong_height_is_refused():
    ids, src, dst = _case(4, 3, True)
    with pytest.raises(ValueError, match=r"a table shard of 7 rows for ids \[5, 13\)"):
        copy_owned_rows(ids, src, dst, LO, HI + 1, lookup=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lookup", [True, False])
@pytest.mark.parametrize("zero", [ZERO_NONE, ZERO_INVALID, ZERO_UNOWNED])
def test_the_owned_rows_are_copied_by_rule_on_gpu(lookup, zero):
    ids, src, dst = _case(1000, 2560 + 3, lookup, device="cuda")
    expected = _spelled_out(ids.cpu(), src.cpu(), dst.cpu(), lookup, zero)
    copy_owned_rows(ids, src, dst, LO, HI, lookup=lookup, zero=zero, valid_hi=VALID_HI)
    assert torch.equal(dst.cpu(), expected)
