"""model.init_from: a run started from a saved Hugging Face model (GPT-2, Llama) evaluates, before any
step, to that model's own loss on the same held-out batch, at tp=1 and tp=2."""
import pytest
import torch
import torch.nn.functional as F

from tests.train.common import tiny_config, write_corpus
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo on CPU even where GPUs are visible

VOCAB = 300  # holds the byte tokenizer's 256 ids


def save_tiny_hf(family, directory, vocab=VOCAB):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def eval_against_hf_body(cfg):
    """(the trainer's eval loss before any step, the HF model's loss on the same held-out batch)."""
    import transformers
    trainer = Trainer(cfg)
    got = trainer.evaluate()
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.model["init_from"], local_files_only=True).eval()
    x, y = trainer.eval_data.batch(range(cfg.train.batch_size))
    with torch.no_grad():
        want = F.cross_entropy(hf(x).logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    return got, want


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_run_from_a_hugging_face_model_starts_at_its_loss(ranks, tmp_path, family, tp, sequence_parallel):
    hf_dir = save_tiny_hf(family, str(tmp_path / family))
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=tp,
                      model={"init_from": hf_dir, "sequence_parallel": sequence_parallel})
    for got, want in ranks(tp).run(eval_against_hf_body, cfg):
        assert abs(got - want) < 1e-4, f"eval loss {got} against the Hugging Face model's {want}"


def _run_body(cfg):
    Trainer(cfg).run()


def test_the_hugging_face_load_is_timed_with_the_size_of_its_weights(ranks, tmp_path):
    import json
    import os
    hf_dir = save_tiny_hf("llama", str(tmp_path / "llama"))
    logs = str(tmp_path / "logs")
    cfg = tiny_config(write_corpus(str(tmp_path)), model={"init_from": hf_dir}, train={"steps": 1}, log={"dir": logs})
    ranks(1).run(_run_body, cfg)
    with open(os.path.join(logs, "metrics.jsonl")) as f:
        loads = [r for r in map(json.loads, f) if r["kind"] == "checkpoint" and "hf_load_s" in r]
    weights = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
    assert len(loads) == 1 and loads[0]["step"] == 0 and loads[0]["hf_load_s"] > 0
    assert loads[0]["GB"] == weights / 1e9


def test_init_from_with_a_preset_is_refused(tmp_path):
    cfg = tiny_config(write_corpus(str(tmp_path)), model={"init_from": str(tmp_path), "preset": "gpt2-tiny"})
    with pytest.raises(ValueError, match=r"model.preset='gpt2-tiny' and model.init_from=.* both choose the model"):
        Trainer(cfg)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    hf_dir = save_tiny_hf("gpt2", str(tmp_path / "small"), vocab=101)
    cfg = tiny_config(write_corpus(str(tmp_path)), model={"init_from": hf_dir})
    with pytest.raises(ValueError, match="the tokenizer has 256 ids but model.init_from=.* has a vocabulary of 101"):
        Trainer(cfg)


def test_a_directory_without_a_model_is_refused(tmp_path):
    cfg = tiny_config(write_corpus(str(tmp_path)), model={"init_from": str(tmp_path / "nothing")})
    with pytest.raises(ValueError, match="model.init_from=.* is not a local Hugging Face model directory"):
        Trainer(cfg)


def train_then_restart_body(cfg):
    """(eval loss after 2 steps and a save, eval loss of a new Trainer that resumes from that save)."""
    first = Trainer(cfg)
    for _ in range(2):
        first.train_step()
    first.save()
    trained = first.evaluate()
    second = Trainer(cfg)
    return trained, second.evaluate(), second.step


def test_a_resumed_run_keeps_its_trained_weights_not_the_hugging_face_ones(ranks, tmp_path):
    hf_dir = save_tiny_hf("gpt2", str(tmp_path / "gpt2"))
    cfg = tiny_config(write_corpus(str(tmp_path)), model={"init_from": hf_dir},
                      checkpoint={"dir": str(tmp_path / "ckpt")})
    trained, resumed, step = ranks(1).run(train_then_restart_body, cfg)[0]
    assert step == 2 and resumed == trained


def test_a_resumed_zero3_run_keeps_its_trained_weights_not_the_hugging_face_ones(ranks, tmp_path):
    hf_dir = save_tiny_hf("llama", str(tmp_path / "llama"))
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=1, fsdp="zero3", model={"init_from": hf_dir},
                      checkpoint={"dir": str(tmp_path / "ckpt")})
    for trained, resumed, step in ranks(2).run(train_then_restart_body, cfg):
        assert step == 2 and abs(resumed - trained) < 1e-6, (trained, resumed)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # tied and untied embeddings
def test_a_run_from_a_hugging_face_model_under_zero3_starts_at_its_loss(ranks, tmp_path, family):
    hf_dir = save_tiny_hf(family, str(tmp_path / family))
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=1, fsdp="zero3", model={"init_from": hf_dir})
    for got, want in ranks(2).run(eval_against_hf_body, cfg):
        assert abs(got - want) < 1e-4, f"eval loss {got} against the Hugging Face model's {want}"


def blocks_materialized_body(cfg):
    import torch.nn as nn
    from tpflash.models import GPT, GPTConfig
    from tpflash.train.loop import Trainer
    given_storage = []
    to_empty = nn.Module.to_empty

    def recording(module, *, device, recurse=True):
        given_storage.append((module, recurse))
        return to_empty(module, device=device, recurse=recurse)
    nn.Module.to_empty = recording
    try:
        trainer = Trainer(cfg, GPTConfig, GPT)
    finally:
        nn.Module.to_empty = to_empty
    inside = {id(m) for block in trainer.model.blocks for m in block.modules()}
    return [type(m).__name__ for m, recurse in given_storage if id(m) in inside or (recurse and m is trainer.model)]


def test_zero3_loads_a_hugging_face_model_into_its_shards_without_materializing_the_blocks(ranks, tmp_path):
    hf_dir = save_tiny_hf("llama", str(tmp_path / "llama"))
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=1, fsdp="zero3", model={"init_from": hf_dir})
    assert ranks(2).run(blocks_materialized_body, cfg) == [[], []], "a block was given whole storage"
