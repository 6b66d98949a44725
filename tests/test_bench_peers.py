"""The plain-PyTorch peers that scripts/bench_e2e.py times tpflash against compute the same model:
loaded with tpflash's weights, they train alike (on CPU)."""
import argparse
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_e2e import MODELS, build, make_optimizer  # noqa: E402
from e2e_peers import load_tpflash_weights, plain_key  # noqa: E402

ONE_PROCESS = SimpleNamespace(tp_size=1, dp_size=1, device=torch.device("cpu"), tp_group=None, tp_mesh=None)


def losses(model, loss_fn, args, device, steps):
    """The losses of `steps` AdamW steps on one fixed batch (as bench_e2e times it)."""
    opt = make_optimizer(model, device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1234))
    out = []
    for _ in range(steps):
        loss = loss_fn(idx[:, :-1].to(device), idx[:, 1:].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_the_plain_peer_with_tpflash_weights_computes_tpflash_loss_and_gradients(model):
    shape = MODELS[model]
    llama = shape.get("family") == "llama"
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dp_mode="replicate", dtype="fp32")
    torch.manual_seed(0)
    tp_model, tp_loss, _ = build("tpflash", shape, args, ONE_PROCESS)
    plain, _, _ = build("plain", shape, args, ONE_PROCESS)
    load_tpflash_weights(plain, tp_model, llama)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    ours, theirs = tp_loss(idx[:, :-1], idx[:, 1:]), plain(idx[:, :-1], idx[:, 1:])
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-5
    plain_params = dict(plain.named_parameters())
    for name, p in tp_model.named_parameters():  # the gradients see what the loss at init hardly does
        g, ref = p.grad, plain_params[plain_key(name, llama)].grad
        # + an absolute floor: k's bias gets no gradient (a shift of every score by q . b_k), only noise
        assert (g - ref).norm() <= 1e-4 * ref.norm() + 1e-8, name


def test_the_plain_peer_with_tpflash_weights_trains_like_tpflash():
    shape = MODELS["tiny-llama"]
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dp_mode="replicate", dtype="fp32")
    torch.manual_seed(0)
    tp_model, tp_loss, _ = build("tpflash", shape, args, ONE_PROCESS)
    plain, _, _ = build("plain", shape, args, ONE_PROCESS)
    load_tpflash_weights(plain, tp_model, llama=True)
    ours, theirs = (losses(m, fn, args, ONE_PROCESS.device, 3) for m, fn in ((tp_model, tp_loss), (plain, plain)))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)


def test_tpflash_keys_map_onto_the_plain_peers_names():
    assert plain_key("blocks.3.attn.k_proj.weight", llama=True) == "blocks.3.attn.k.weight"
    assert plain_key("blocks.0.mlp.gate_proj.weight", llama=True) == "blocks.0.mlp.gate.weight"
    assert plain_key("blocks.0.mlp.up_proj.bias", llama=False) == "blocks.0.fc.bias"
    assert plain_key("final_norm.weight", llama=False) == "norm.weight"
