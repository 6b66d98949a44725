"""Only loss-carrying tokens get gradient, and a packed row trains like its documents run one by one.

Run on tpflash's GPT (learned positions and rotary) and on the tests' stand-in, at tp=1 in fp32,
through the interface the trainer uses: model(idx, targets, position_ids=, cu_seqlens=,
max_seqlen=, reduction="sum"), divided by the count of loss-carrying targets.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.train.sft_common import PackedTinyLM, arithmetic_records
from tests.train.tiny_model import TinyConfig
from tpflash.models import GPT, GPTConfig
from tpflash.train.data import ByteTokenizer
from tpflash.train.packing import IGNORE_INDEX, PAD_ID, best_fit, document, forward_kwargs, pack
from tpflash.train.sft_data import encode_record

SEQ = 32
MODELS = {
    "gpt2": lambda: GPT(GPTConfig.preset("gpt2-tiny", vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=32)),
    "llama": lambda: GPT(GPTConfig.preset("llama-tiny", vocab_size=256, block_size=SEQ, n_layer=2, n_head=4,
                                          n_kv_head=2, n_embd=32)),
    "stand-in": lambda: PackedTinyLM(TinyConfig(vocab_size=256, block_size=SEQ)),
}


@pytest.fixture(params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().float()


def _packed(n_examples=12):
    """(examples, their documents, rows packed from them in order, the row of each document)."""
    examples = [encode_record(r, ByteTokenizer(), f"f:{k}") for k, r in enumerate(arithmetic_records(n_examples))]
    docs = [document(ex, SEQ) for ex in examples]
    groups = best_fit([len(ids) for ids, _ in docs], SEQ)
    return examples, docs, pack(docs, SEQ), groups


def _grads(model, inputs, targets, batch, count):
    """Every parameter's gradient of the batch's summed loss / count."""
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets, **forward_kwargs(batch, lambda t: t)) / count
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(a, b, tol=1e-6):
    for name in a:
        assert torch.allclose(a[name], b[name], atol=tol, rtol=tol), f"{name}: gradients differ"


def _assert_differ(a, b):
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4, "the gradient did not change"


def test_packed_rows_train_like_their_documents_run_one_by_one(model):
    examples, docs, rows, groups = _packed()
    batch = rows.batch([0, 1])
    count = rows.loss_tokens([0, 1])
    packed = _grads(model, batch.inputs, batch.targets, batch, count)
    model.zero_grad(set_to_none=True)
    for k in groups[0] + groups[1]:  # the reference: each example alone, its loss mask applied by hand
        ids = torch.from_numpy(examples[k].ids[:SEQ])
        counted = torch.from_numpy(examples[k].loss[1:len(ids)])  # token j + 1 predicted from position j
        logits = model(ids[None])[0, :-1].float()
        (F.cross_entropy(logits[counted], ids[1:][counted], reduction="sum") / count).backward()
    one_by_one = {name: p.grad.clone() for name, p in model.named_parameters()}
    _assert_same(packed, one_by_one, tol=1e-5)


def test_padding_and_the_last_token_of_each_document_carry_no_gradient(model):
    _, _, rows, _ = _packed()
    last = len(rows) - 1  # the last row is the emptiest: it ends in padding (PAD_ID 0; bytes here are never 0)
    batch = rows.batch([0, last])
    assert batch.inputs[1, -1] == PAD_ID, "the test needs a row that ends in padding"
    count = rows.loss_tokens([0, last])
    reference = _grads(model, batch.inputs, batch.targets, batch, count)
    ends = torch.cumsum(torch.from_numpy(np.concatenate([rows.doc_lens(0), rows.doc_lens(last)])), 0) - 1
    assert (batch.targets.reshape(-1)[ends] == IGNORE_INDEX).all()
    changed = batch.inputs.clone().reshape(-1)
    changed[ends] = (changed[ends] + 17) % 256  # each document's last input (the padding's too)
    # no later token of its document sees it, other documents do not see it, and it predicts nothing
    _assert_same(_grads(model, changed.reshape(batch.inputs.shape), batch.targets, batch, count), reference)
    changed = batch.inputs.clone()
    changed[1, SEQ - int(rows.doc_lens(last)[-1]):] = 42  # all of the padding
    _assert_same(_grads(model, changed, batch.targets, batch, count), reference)


def test_a_completion_target_changes_the_gradient_and_so_would_an_unmasked_prompt_one(model):
    _, _, rows, _ = _packed()
    batch = rows.batch([0])
    count = rows.loss_tokens([0])
    reference = _grads(model, batch.inputs, batch.targets, batch, count)
    counted = (batch.targets[0] != IGNORE_INDEX).nonzero()[0, 0]
    changed = batch.targets.clone()
    changed[0, counted] = (changed[0, counted] + 1) % 256
    _assert_differ(_grads(model, batch.inputs, changed, batch, count), reference)
    unmasked = batch.targets.clone()
    unmasked[0, 0] = batch.inputs[0, 1]  # the first prompt position, given its next token as a target
    _assert_differ(_grads(model, batch.inputs, unmasked, batch, count), reference)


def test_one_example_per_row_skips_boundaries_and_equals_the_varlen_path(model):
    """pack=false rows (an example, then padding) run plain causal attention: the same loss and
    gradients as giving the model the rows' documents (example | padding) explicitly."""
    _, docs, _, _ = _packed(4)
    rows = pack(docs, SEQ, packed=False)
    batch = rows.batch(range(len(rows)))
    assert batch.cu_seqlens is None and forward_kwargs(batch, lambda t: t) == {"reduction": "sum"}
    lens = [len(ids) for ids, _ in docs]
    cu = torch.tensor(np.cumsum([0] + [n for k in lens for n in (k, SEQ - k) if n]), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for k in lens for n in (k, SEQ - k) if n]).view(len(lens), SEQ)
    count = rows.loss_tokens(range(len(rows)))
    plain = _grads(model, batch.inputs, batch.targets, batch, count)
    model.zero_grad(set_to_none=True)
    (model(batch.inputs, batch.targets, position_ids=positions, cu_seqlens=cu, max_seqlen=SEQ,
           reduction="sum") / count).backward()
    _assert_same(plain, {name: p.grad.clone() for name, p in model.named_parameters()}, tol=1e-5)
