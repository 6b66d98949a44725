"""The DTensor peer that benchmarks/bench_e2e.py times tpflash against (torchtitan's TP plans for GPT-2 and
Llama blocks) computes the plain model's loss and gradients at tp=2: the rows it gives are of the same model."""
import argparse
import os
import sys

import pytest
import torch

from tests.distributed.checks import assert_close, init_tp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from bench_e2e import MODELS, build  # noqa: E402

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU models: gloo even where GPUs are visible


def dtensor_body(model_name):
    ps = init_tp(2)
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dp_mode="replicate", dtype="fp32")
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    models = {}
    for impl in ("plain", "dtensor"):
        torch.manual_seed(0)  # the same weights: parallelize_module shards the model as initialised
        model, loss_fn, step_context = build(impl, MODELS[model_name], args, ps)
        with step_context():
            loss = loss_fn(idx[:, :-1], idx[:, 1:])
            loss.backward()
        models[impl] = (model, loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    (plain, plain_loss), (sharded, sharded_loss) = models["plain"], models["dtensor"]
    assert_close(sharded_loss.detach(), plain_loss.detach(), "loss", tol=1e-6)
    reference = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        grad, ref = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, reference[name].grad
        # + an absolute floor: k's bias gets no gradient (a shift of every score by q . b_k), only noise
        assert (grad - ref).norm() <= 1e-4 * ref.norm() + 1e-8, name


@pytest.mark.parametrize("model_name", ["tiny", "tiny-llama"])
def test_dtensor_peer_at_tp2_computes_the_plain_models_loss_and_gradients(ranks, model_name):
    ranks(2).run(dtensor_body, model_name)
