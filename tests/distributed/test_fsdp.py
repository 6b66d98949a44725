"""apply_fsdp: 2-D FSDP x TP (and HSDP) training equals single-process training, also sharded over dp x cp;
wrapping policies."""
import types

import pytest
import torch
import torch.nn as nn

import tpflash
from tests.checkpoint.tiny_model import TinyBlock, TinyLM, batch, build, full_state, make_optimizer, train, unshard
from tests.distributed.checks import assert_close, init_layout, init_tp
from tpflash.parallel.fsdp import apply_fsdp, block_wrap_policy, hsdp_mesh, select_units, size_wrap_policy

pytestmark = pytest.mark.cpu_ranks  # the tiny models live on CPU: gloo even where GPUs are visible

STEPS = 3


def assert_trains_like_one_process(model, data_rank, data_ranks):
    """Train the sharded model on this rank's rows (rank `data_rank` of `data_ranks`) and the same
    model in one process on every row; weights and optimizer state must end equal."""
    reference = build(seed=0, tp=False)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    train(model, optimizer, range(STEPS), data_rank, data_ranks)
    train(reference, ref_optimizer, range(STEPS))
    got, expected = full_state(model, optimizer), full_state(reference, ref_optimizer)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(got[key], value, key, tol=1e-5)


def training_body(tp, hsdp_replicas, reshard_after_forward):
    ps = init_tp(tp)
    model = apply_fsdp(build(seed=0), ps, hsdp_replicas=hsdp_replicas, reshard_after_forward=reshard_after_forward)
    assert_trains_like_one_process(model, ps.dp_rank, ps.dp_size)


@pytest.mark.parametrize("tp,hsdp_replicas,reshard", [(2, 1, True), (1, 1, False), (1, 2, True)],
                         ids=["dp2-tp2", "dp4-no-reshard", "hsdp2x2"])
def test_fsdp_training_equals_single_process_training(ranks, tp, hsdp_replicas, reshard):
    ranks(4).run(training_body, tp, hsdp_replicas, reshard)


def cp_training_body(tp, cp):
    """cp ranks hold the same parameters as dp peers: FSDP shards over all dp * cp of them. The tiny
    model is not context-parallel, so here every dp * cp rank simply trains on its own rows."""
    ps = init_layout(tp, cp)
    model = apply_fsdp(build(seed=0), ps)
    for name, p in model.named_parameters():
        assert p.device_mesh == ps.dp_cp_mesh and p.device_mesh.size() == ps.dp_size * cp, name
        if p.shape[0] % ps.dp_cp_size == 0:
            assert p.to_local().shape[0] == p.shape[0] // ps.dp_cp_size, (name, p.to_local().shape, p.shape)
    assert_trains_like_one_process(model, ps.dp_cp_rank, ps.dp_cp_size)


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)], ids=["dp2-cp2", "dp1-cp2-tp2"])
def test_fsdp_shards_over_dp_times_cp_and_trains_like_one_process(ranks, tp, cp):
    ranks(4).run(cp_training_body, tp, cp)


def mixed_precision_body():
    """bf16 compute (param_dtype), fp32 master parameters and fp32 reduced gradients, at dp=2 x tp=2."""
    ps = init_tp(2)
    model = apply_fsdp(build(seed=0), ps, param_dtype=torch.bfloat16)
    reference = build(seed=0, tp=False)
    ids, targets = batch(0)
    rows = slice(ps.dp_rank * len(ids) // ps.dp_size, (ps.dp_rank + 1) * len(ids) // ps.dp_size)
    loss = model(ids[rows], targets[rows])
    assert loss.dtype == torch.bfloat16, loss.dtype
    loss.backward()
    reference(ids, targets).backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (name, p.dtype, p.grad.dtype)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert_close(unshard(model, name, grads[name]), p.grad, f"{name} grad", tol=5e-2)


def test_bf16_compute_keeps_fp32_master_weights_and_gradients(ranks):
    ranks(4).run(mixed_precision_body)


def wrapping_body():
    ps = init_tp(1)
    model = apply_fsdp(build(seed=0), ps)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    assert isinstance(model, FSDPModule)
    assert all(isinstance(b, FSDPModule) for b in model.blocks), "every block is its own FSDP unit"
    assert not isinstance(model.embed, FSDPModule), "embeddings and head stay in the root unit (tied weights)"
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_apply_fsdp_shards_each_block_then_the_root(ranks):
    ranks(1).run(wrapping_body)


def test_block_wrap_policy_selects_blocks():
    model = TinyLM()
    units = select_units(model, auto_wrap_policy=block_wrap_policy({TinyBlock}))
    assert units == list(model.blocks)


def test_model_block_class_is_the_default_policy():
    model = TinyLM()
    assert select_units(model) == list(model.blocks)


def test_size_wrap_policy_selects_modules_over_the_threshold():
    model = TinyLM()
    block_params = sum(p.numel() for p in model.blocks[0].parameters())
    up_params = sum(p.numel() for p in model.blocks[0].up.parameters())
    units = select_units(nn.Sequential(*model.blocks), auto_wrap_policy=size_wrap_policy(up_params))
    # each block's `up` reaches the threshold; what is left of the block (norm, down) does not
    assert all(sum(p.numel() for p in u.parameters()) >= up_params for u in units)
    assert model.blocks[0].up in units and model.blocks[0] not in units
    assert block_params > up_params


def test_hsdp_replicas_must_divide_dp():
    fake = types.SimpleNamespace(dp_size=4, tp_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="hsdp_replicas=3 must be >= 1 and divide dp=4"):
        hsdp_mesh(fake, 3)


def test_hsdp_with_context_parallelism_is_refused():
    tpflash.parallel.set_default_state(None)
    fake = types.SimpleNamespace(dp_size=2, cp_size=2, tp_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="hsdp_replicas=2 with cp=2 is not supported"):
        apply_fsdp(TinyLM(), fake, hsdp_replicas=2)


def test_apply_fsdp_without_parallel_state_raises():
    tpflash.parallel.set_default_state(None)
    with pytest.raises(ValueError, match="needs a ParallelState"):
        apply_fsdp(TinyLM())


def test_prefetch_chains_the_blocks_in_forward_order():
    from tpflash.parallel.fsdp import _sibling_chains
    model = build(seed=0, tp=False)
    units = select_units(model)
    assert _sibling_chains(model, units) == [list(model.blocks)]
    assert _sibling_chains(model, units[:1]) == [], "a lone unit has nothing to prefetch"
