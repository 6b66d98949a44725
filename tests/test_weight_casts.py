"""weight_casts: one multi-tensor cast of a block's weights per forward, whose views the layers use
instead of casting each weight; values equal the per-tensor casts, and every cast a block's
layers ask for under autocast is found there."""
import contextlib

import pytest
import torch

from tpflash.layers import ParallelTransformerBlock, weight_casts
from tpflash.layers import block as block_module
from tpflash.layers.graphed_blocks import GraphedBlocks

BF16 = torch.bfloat16


def test_a_cast_gives_each_tensor_and_each_group_stacked():
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    b = torch.randn(4)
    casts = weight_casts.cast_now([(q, k, v), (b,)], BF16)
    stacked = weight_casts.stacked_cast([q, k, v], BF16, casts)
    assert torch.equal(stacked, torch.cat([q, k, v]).to(BF16)) and stacked.shape == (8, 3)
    for t in (q, k, v, b):
        view = weight_casts.cached_cast([t], BF16, casts)
        assert view is not None and torch.equal(view, t.to(BF16))
    assert weight_casts.cached_cast([q, k], BF16, casts) is None, "only the groups given are stacked"
    assert weight_casts.cached_cast([q], torch.float16, casts) is None, "another dtype is not cached"
    assert weight_casts.cached_cast([q], BF16, None) is None, "no casts given, none found"
    assert torch.equal(weight_casts.stacked_cast([q, k, v], BF16), torch.cat([q, k, v]).to(BF16))


def test_tensors_stacked_in_one_storage_already_are_viewed_not_copied():
    flat = torch.randn(24)
    q, k, v = flat[:12].view(4, 3), flat[12:18].view(2, 3), flat[18:].view(2, 3)
    stacked = weight_casts.stacked_cast([q, k, v], torch.float32)
    assert stacked.data_ptr() == flat.data_ptr() and torch.equal(stacked, torch.cat([q, k, v]))
    apart = [q, flat[18:].view(2, 3)]  # not adjacent: copied
    assert weight_casts.stacked_cast(apart, torch.float32).data_ptr() != flat.data_ptr()
    assert torch.equal(weight_casts.stacked_cast([q, k, v], BF16), torch.cat([q, k, v]).to(BF16)), "another dtype: cast"


def test_an_alias_of_a_cast_tensor_finds_its_cast():
    w = torch.nn.Parameter(torch.randn(3, 5))
    casts = weight_casts.cast_now([(w,)], BF16)
    assert weight_casts.cached_cast([w.view_as(w)], BF16, casts) is not None


def test_groups_with_none_or_already_in_dtype_are_left_out():
    w, half, other = torch.randn(3, 5), torch.randn(3, 5).to(BF16), torch.randn(2, 5)
    casts = weight_casts.cast_now([(w, None), (half,), (other,)], BF16)
    assert weight_casts.cached_cast([w], BF16, casts) is None
    assert weight_casts.cached_cast([half], BF16, casts) is None
    assert weight_casts.cached_cast([other], BF16, casts) is not None, "the castable group still is"


def test_no_dtype_means_no_cast():
    assert weight_casts.cast_now([(torch.randn(3, 5),)], None) is None


@contextlib.contextmanager
def _recording_lookups():
    """(hits, misses): the tensors-lists the layers asked weight_casts for, by outcome."""
    hits, misses, real = [], [], weight_casts.cached_cast

    def recording(tensors, dtype, casts):
        found = real(tensors, dtype, casts)
        (hits if found is not None else misses).append([tuple(t.shape) for t in tensors])
        return found
    weight_casts.cached_cast = recording
    try:
        yield hits, misses
    finally:
        weight_casts.cached_cast = real


FAMILIES = {"gpt2": dict(n_kv_head=4, mlp="gelu", norm="layernorm", position="learned", bias=True),
            "llama": dict(n_kv_head=2, mlp="swiglu", norm="rmsnorm", position="rotary", bias=False)}


def _block(family):
    torch.manual_seed(0)
    return ParallelTransformerBlock(32, 4, ffn_hidden=64, **FAMILIES[family])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_cast_a_block_asks_for_under_autocast_was_made_on_entry(family):
    block, x = _block(family), torch.randn(8, 2, 32)
    with _recording_lookups() as (hits, misses), torch.autocast("cpu", dtype=BF16):
        out, residual = block(x)
    assert hits and not misses, f"casts not made on entry: {misses}"
    (out.float() + residual.float()).sum().backward()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_block_computes_the_same_with_and_without_the_one_cast(family, monkeypatch):
    x = torch.randn(8, 2, 32)
    results = []
    for one_cast in (True, False):
        if not one_cast:
            monkeypatch.setattr(block_module, "cast_now", lambda groups, dtype: None)
        block, xi = _block(family), x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16):
            out, residual = block(xi)
        (out.float() * 1.5 + residual.float()).sum().backward()
        results.append([out, xi.grad] + [p.grad for p in block.parameters()])
    for with_cast, without in zip(*results):
        assert torch.equal(with_cast, without)


def test_a_graphed_stack_casts_each_blocks_weights_in_one_multi_tensor_copy(monkeypatch):
    blocks = [_block("gpt2") for _ in range(3)]
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: calls.append(len(src)) or real(dst, src))
    with torch.autocast("cpu", dtype=BF16):
        graphed = GraphedBlocks(blocks, torch.randn(8, 2, 32))
        calls.clear()
        with _recording_lookups() as (hits, misses):
            graphed(torch.randn(8, 2, 32))
    expected = [sum(1 for g in b.weight_cast_groups() for t in g if t is not None) for b in blocks]
    assert calls == expected, f"multi-tensor copies of {calls} tensors, expected one per block of {expected}"
    assert not misses


def test_a_prepared_cast_is_found_before_it_is_filled_and_filled_once(monkeypatch):
    w, b = torch.randn(4, 3), torch.randn(4)
    cast = weight_casts.prepare_cast([(w,), (b,)], BF16)
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: copies.append(len(src)) or real(dst, src))
    view = weight_casts.cached_cast([w], BF16, cast)
    assert view is not None and copies == [], "the views exist before any copy is issued"
    cast.fill()
    cast.fill()
    assert copies == [2], f"copies issued: {copies}"
    assert torch.equal(view, w.to(BF16)) and torch.equal(weight_casts.cached_cast([b], BF16, cast), b.to(BF16))
