"""fsdp=zero3 on GPUs: over NCCL with real CUDA graphs (bf16 gathers, the side stream and its events
captured), against FSDP2 with bf16 parameters: the same mixed precision. The CPU twins, the same
bodies over gloo with the graphs' eager stand-in (in fp32 against DDP, in bf16 against FSDP2), are
in test_zero3.py (fp8 included)."""
import pytest

from tests.distributed.test_zero3 import trains_like_the_reference_body

pytestmark = pytest.mark.gpu

LAYOUTS = pytest.mark.parametrize("world,tp", [(2, 1), (4, 2), (4, 1)], ids=["dp2", "dp2-tp2", "dp4"])


@LAYOUTS
def test_a_graphed_gpt_under_zero3_trains_like_the_eager_gpt_under_fsdp2_in_bf16(ranks, world, tp):
    ranks(world).run(trains_like_the_reference_body, tp, True)


@LAYOUTS
def test_a_graphed_gpt_under_zero3_accumulates_micro_batches_like_fsdp2_in_bf16(ranks, world, tp):
    ranks(world).run(trains_like_the_reference_body, tp, True, 2)


@LAYOUTS
def test_an_eager_gpt_under_zero3_with_accumulation_trains_like_fsdp2_in_bf16(ranks, world, tp):
    ranks(world).run(trains_like_the_reference_body, tp, False, 2)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_graphed_gpt_under_zero3_with_fp8_gemms_trains_like_fsdp2_with_them(ranks, recipe):
    # tensorwise: the backward multiplies the fp8 weights its forward saved and gathers none again
    ranks(2).run(trains_like_the_reference_body, 1, True, 1, False, 64, None, recipe)


def test_a_graphed_gpt_under_zero3_with_fp8_tensorwise_and_recomputation_trains_like_fsdp2(ranks):
    ranks(2).run(trains_like_the_reference_body, 1, True, 1, "activation", 64, None, "tensorwise")
