"""ShardedBlocks (fsdp=zero3): the blocks' weights sharded over dp and gathered into two static slots,
the rest under FSDP2; training equal to DDP's, eager and graphed (on CPU the graphs' eager stand-in)."""
import contextlib

import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tests.distributed.test_graphed_blocks import BATCH, SEQ, VOCAB, batch, twins
from tpflash.models import GPTConfig
from tpflash.parallel import apply_fsdp, replicate_over_dp, shard_blocks

pytestmark = pytest.mark.cpu_ranks

STEPS = 3


def _config(sequence_parallel, ffn_hidden=64, **kw):
    # four blocks: the backward gathers blocks 1 and 0 again (the slots hold 3 and 2 after the forward)
    return GPTConfig.preset("gpt2-tiny", vocab_size=VOCAB, block_size=16, n_layer=4, n_embd=32, n_head=4,
                            ffn_hidden=ffn_hidden, sequence_parallel=sequence_parallel, tie_embeddings=False, **kw)


def _reference_over_dp(reference, ps, compute_dtype):
    """fp32: DDP. bf16 compute: FSDP2 with bf16 parameters, the same mixed precision as zero3's (fp32 masters,
    every block weight gathered in bf16, fp32 reduction); DDP under autocast would keep norm weights and
    biases in fp32, where AdamW's first steps are below bf16's resolution."""
    if compute_dtype is None:
        return replicate_over_dp(reference, ps)
    return apply_fsdp(reference, ps, param_dtype=compute_dtype)


def _mixed_precision(device, compute_dtype):
    if compute_dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=compute_dtype)


def trains_like_the_reference_body(tp, graphed, micro_batches=1, checkpointing=False, ffn_hidden=64, bf16=None,
                                   fp8="off"):
    """zero3 against DDP (fp32, CPU) or FSDP2 with bf16 parameters (bf16 compute: always on CUDA)."""
    ps = init_tp(tp)
    device = ps.device
    compute_dtype = torch.bfloat16 if (device.type == "cuda" if bf16 is None else bf16) else None
    model, reference = twins(_config(tp > 1, ffn_hidden, activation_checkpointing=checkpointing, fp8=fp8), device)
    sharded = shard_blocks(model, ps, compute_dtype=compute_dtype)
    if graphed:
        with _mixed_precision(device, compute_dtype):
            sharded.capture_cuda_graphs(model, BATCH, SEQ)
    peer = _reference_over_dp(reference, ps, compute_dtype)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, reference)]
    tol = 1e-5 if device.type == "cpu" else 2e-2
    for step in range(STEPS):
        losses = []
        for forward, opt in zip((model, peer), opts):
            for micro in range(micro_batches):
                idx, targets = batch(100 * step + micro_batches * ps.dp_rank + micro, device)
                with _mixed_precision(device, compute_dtype):
                    loss = forward(idx, targets) / micro_batches
                last = micro == micro_batches - 1
                with peer.no_sync() if forward is peer and hasattr(peer, "no_sync") and not last \
                        else contextlib.nullcontext():
                    loss.backward()
                losses.append(loss.detach().float())
            if forward is model:  # the hooks took every block gradient: none is kept whole on a leaf
                sharded.wait_for_gradients()
                assert all(t.grad is None for leaves in sharded.leaves for t in leaves.values())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if forward is model:
                sharded.new_step()
        assert_close(sum(losses[:micro_batches]), sum(losses[micro_batches:]), f"step {step}: loss", tol=tol)
    if graphed:
        primes = fp8 == "delayed"  # the first forward records the amax histories, eagerly
        assert model._graphed_blocks.forward_generation == STEPS * micro_batches - primes, "the replays did not run"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert hasattr(p, "device_mesh"), f"{name} is not sharded"
        if name.endswith("k_proj.bias"):  # its exact gradient is 0 (softmax ignores a shift of every key):
            continue  # AdamW turns rounding noise into full-size steps, different in any other summation order
        q = q.full_tensor() if hasattr(q, "full_tensor") else q
        assert_close(p.full_tensor(), q, f"{name} after {STEPS} steps", tol=tol)


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["dp2", "dp2-tp2"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_zero3_trains_like_ddp(ranks, world, tp, graphed):
    ranks(world).run(trains_like_the_reference_body, tp, graphed)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_zero3_on_one_dp_rank_trains_like_the_unsharded_model(ranks, graphed):
    ranks(1).run(trains_like_the_reference_body, 1, graphed)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_zero3_accumulates_micro_batches_like_ddp(ranks, graphed):
    ranks(2).run(trains_like_the_reference_body, 1, graphed, 2)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("checkpointing", ["activation", "full", "mlp", "selective"])
def test_zero3_recomputes_checkpointed_blocks_with_their_gathered_weights(ranks, checkpointing, graphed):
    ranks(2).run(trains_like_the_reference_body, 1, graphed, 1, checkpointing)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_zero3_in_bf16_computes_what_fsdp2_with_bf16_parameters_computes(ranks, graphed):
    ranks(2).run(trains_like_the_reference_body, 1, graphed, 1, False, 64, True)


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "delayed"])
def test_zero3_with_fp8_gemms_computes_what_fsdp2_with_them_computes(ranks, recipe, graphed):
    ranks(2).run(trains_like_the_reference_body, 1, graphed, 1, False, 64, True, recipe)


@pytest.mark.parametrize("checkpointing", ["activation", "full"])
def test_zero3_with_fp8_tensorwise_and_recomputation_computes_what_fsdp2_computes(ranks, checkpointing):
    ranks(2).run(trains_like_the_reference_body, 1, True, 1, checkpointing, 64, True, "tensorwise")


def test_rows_that_do_not_divide_by_dp_are_padded_and_train_like_ddp(ranks):
    ranks(4).run(trains_like_the_reference_body, 1, True, 1, None, 70)  # up_proj's 70 rows: 18 per rank, 16 on the last


def stacked_body():
    from tpflash.layers import weight_casts
    ps = init_tp(1)
    model, _ = twins(GPTConfig.preset("llama-tiny", vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=32, n_head=4,
                                      n_kv_head=2, ffn_hidden=64), ps.device)
    sharded = shard_blocks(model, ps)
    leaves = sharded.leaves[1]
    for names in (["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
                  ["mlp.up_proj.weight", "mlp.gate_proj.weight"]):
        tensors = [leaves[n] for n in names]
        assert weight_casts.stacked_cast(tensors, tensors[0].dtype).data_ptr() == tensors[0].data_ptr(), names


def test_the_weights_a_layer_stacks_are_gathered_side_by_side(ranks):
    ranks(2).run(stacked_body)


def memory_body():
    ps = init_tp(1)
    model, reference = twins(_config(False), ps.device)
    block_numel = sum(p.numel() for p in reference.blocks.parameters())
    block0 = sum(p.numel() for p in reference.blocks[0].parameters())
    sharded = shard_blocks(model, ps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = batch(0, ps.device)
    model(idx, targets).backward()
    opt.step()
    adam = sum(v.to_local().numel() * v.element_size() for p in sharded.master_params
               for v in opt.state[p].values() if v.dim())
    return block_numel, block0, sharded.bytes_per_rank(), adam


def test_zero3_holds_a_dp_share_of_the_blocks_state_and_two_slots_of_one_block(ranks):
    for n, block0, held, adam in ranks(4).run(memory_body):
        # weights and gradients: 4 bytes per parameter / dp (rows padded to a multiple of dp: none here)
        assert held["params"] == held["grads"] == 4 * n // 4, held
        assert adam == held["adam_state"] == 8 * n // 4, (adam, held)
        assert held["slots"] == (2 + 2) * 4 * block0, held  # two compute and two reduction slots of one block, fp32


def fp8_slots_body():
    ps = init_tp(1)
    held = {}
    for fp8_gathers in (False, True):
        model, _ = twins(_config(False, fp8="tensorwise"), ps.device)
        sharded = shard_blocks(model, ps, compute_dtype=torch.bfloat16, fp8_gathers=fp8_gathers)
        held[fp8_gathers] = sharded.bytes_per_rank()["slots"]
        main_numel = sharded.slots["main"].shape[1]
    return held, main_numel


def test_under_fp8_gathers_the_main_slots_are_fp8_and_the_bf16_ones_hold_no_memory(ranks):
    for held, main_numel in ranks(2).run(fp8_slots_body):
        # two bf16 compute slots (2 bytes an element) replaced by two e4m3 ones (1 byte), plus the rank's
        # cast shard (1 byte per element of its rows: main_numel / 2) and the scales; one bf16 element left
        fp8_extra = held[True] - (held[False] - 2 * 2 * main_numel + 2)
        assert 2 * main_numel + main_numel // 2 <= fp8_extra <= 2 * main_numel + main_numel // 2 + 64, (held, main_numel)


def refusals_body():
    import torch.nn as nn
    from tests.train.tiny_model import TinyConfig, TinyLM
    ps = init_tp(1)
    errors = []
    for model in (TinyLM(TinyConfig(vocab_size=VOCAB, n_embd=8, block_size=16)), twins(_config(False), ps.device)[0]):
        if hasattr(model, "blocks"):
            model.blocks[2].mlp.extra = nn.Parameter(torch.zeros(3))  # one block unlike the others
        try:
            shard_blocks(model, ps)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_a_model_without_blocks_of_one_shape_is_refused_naming_why(ranks):
    errors = ranks(1).run(refusals_body)[0]
    assert errors == ["fsdp=zero3 shards a model's transformer blocks: this model has no `blocks`",
                      "fsdp=zero3 needs blocks of one shape: block 2's parameters differ from block 0's"]


def unused_body():
    import torch.nn as nn
    ps = init_tp(1)
    model, _ = twins(_config(False), ps.device)
    for block in model.blocks:  # a parameter no forward uses
        block.mlp.unused = nn.Parameter(torch.zeros(3))
    shard_blocks(model, ps)
    idx, targets = batch(0, ps.device)
    try:
        model(idx, targets).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_block_parameter_without_a_gradient_fails_the_backward_naming_the_rule(ranks):
    error = ranks(2).run(unused_body)[0]
    assert error and "got no gradient" in error and "fsdp=zero3 needs every block parameter used" in error


def backward_gathers_body(recipe, checkpointing):
    """(regather, the blocks the backward gathered) for a bf16 step of a 4-block model under zero3."""
    ps = init_tp(1)
    model, _ = twins(_config(False, activation_checkpointing=checkpointing, fp8=recipe), ps.device)
    sharded = shard_blocks(model, ps, compute_dtype=torch.bfloat16)
    gathered, gather = [], sharded._gather

    def counting(kind, block, slot):
        if sharded._backward_open:
            gathered.append((kind, block))
        gather(kind, block, slot)

    sharded._gather = counting
    with torch.autocast(ps.device.type, dtype=torch.bfloat16):
        loss = model(*batch(0, ps.device))
    loss.backward()
    return sharded.regather, gathered


@pytest.mark.parametrize("recipe,checkpointing,regathered", [
    ("tensorwise", False, []), ("tensorwise", "activation", []),  # the forward's fp8 weights serve the backward
    ("tensorwise", "full", [("main", 1), ("main", 0)]), ("rowwise", False, [("main", 1), ("main", 0)]),
    ("off", False, [("main", 1), ("main", 0)])])  # the slots hold blocks 3 and 2 after the forward
def test_the_backward_gathers_the_blocks_again_only_where_it_reads_their_weights(ranks, recipe, checkpointing,
                                                                                  regathered):
    for regather, gathered in ranks(2).run(backward_gathers_body, recipe, checkpointing):
        assert regather == bool(regathered)
        assert gathered == regathered


def fp8_gathers_body(recipe, checkpointing):
    """Whether zero3 gathers fp8 weights, and (under fp8 gathers, after a forward) whether the slot of the
    last block holds, bit for bit, the layers' own casts of its gathered bf16 weights, group by group."""
    from tpflash.kernels.fp8 import E4M3, cast_stacked
    ps = init_tp(1)
    model, _ = twins(_config(False, activation_checkpointing=checkpointing, fp8=recipe), ps.device)
    sharded = shard_blocks(model, ps, compute_dtype=torch.bfloat16)
    if sharded.fp8_group is None:
        return False, True
    with torch.autocast(ps.device.type, dtype=torch.bfloat16):
        model(*batch(0, ps.device))
    last = len(sharded.blocks) - 1
    groups = {}
    for piece, group in zip(sharded.pieces["main"], sharded.fp8_group):
        groups.setdefault(group, []).append(piece.path)
    exact = True
    for group, paths in groups.items():
        weights = [sharded.masters[last][path].full_tensor().to(torch.bfloat16) for path in paths]
        ours = [sharded.leaves[last][path].fp8_weight for path in paths]
        reference = cast_stacked(weights, E4M3)
        exact &= torch.equal(torch.cat([w.row for w in ours]).view(torch.uint8), reference.row.view(torch.uint8))
        exact &= bool(ours[0].scale == reference.scale)
    return True, exact


@pytest.mark.parametrize("recipe,checkpointing,fp8_gathers", [
    ("tensorwise", False, True), ("tensorwise", "activation", True),
    ("tensorwise", "full", False),  # the recomputed forward's GEMMs read the weights: gathered as they are
    ("rowwise", False, False), ("off", False, False)])
def test_zero3_gathers_the_weights_in_fp8_where_the_gemms_cast_them_whole_with_one_scale(ranks, recipe, checkpointing,
                                                                                        fp8_gathers):
    for gathers, exact in ranks(2).run(fp8_gathers_body, recipe, checkpointing):
        assert gathers == fp8_gathers
        assert exact, "the gathered fp8 weights are not the layers' casts of the gathered weights"


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_zero3_with_fp8_gathers_computes_what_zero3_without_them_computes(ranks, graphed):
    ranks(2).run(fp8_gathers_equal_body, graphed)


def fp8_gathers_equal_body(graphed):
    """Three bf16 steps of an fp8 tensorwise model under zero3, with and without fp8 gathers: equal losses
    and weights, bit for bit (the same casts of the same values)."""
    ps = init_tp(1)
    results = []
    for fp8_gathers in (True, False):
        torch.manual_seed(0)
        model, _ = twins(_config(False, fp8="tensorwise"), ps.device)
        sharded = shard_blocks(model, ps, compute_dtype=torch.bfloat16, fp8_gathers=fp8_gathers)
        assert (sharded.fp8_group is not None) == fp8_gathers
        if graphed:
            with torch.autocast(ps.device.type, dtype=torch.bfloat16):
                sharded.capture_cuda_graphs(model, BATCH, SEQ)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(STEPS):
            with torch.autocast(ps.device.type, dtype=torch.bfloat16):
                loss = model(*batch(step + 10 * ps.dp_rank, ps.device))
            loss.backward()
            sharded.wait_for_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sharded.new_step()
            losses.append(loss.detach().float())
        results.append((torch.stack(losses), [p.full_tensor() for p in model.parameters()]))
    (losses_a, params_a), (losses_b, params_b) = results
    assert torch.equal(losses_a, losses_b), (losses_a, losses_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
