"""model.init_from streams into FSDP shards (fsdp=on at dp=2 x tp=2 starts at the Hugging Face model's
loss), and checkpoint.export_hf writes, at the end of training (under FSDP or zero3), a directory
transformers loads with the trained model's logits and the source's tokenizer files."""
import os

import pytest
import torch

from tests.train.common import tiny_config, write_corpus
from tests.train.test_init_from import VOCAB, eval_against_hf_body, save_tiny_hf
from tpflash.parallel import comm
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks


def test_init_from_streams_into_fsdp_shards(ranks, tmp_path):
    hf_dir = save_tiny_hf("llama", str(tmp_path / "llama"))
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=2, fsdp="on", model={"init_from": hf_dir})
    for got, want in ranks(4).run(eval_against_hf_body, cfg):
        assert abs(got - want) < 1e-4, f"eval loss {got} against the Hugging Face model's {want}"


def train_and_export_body(cfg):
    """The trained model's logits on a fixed batch (vocabulary gathered over tp), after run() exported it."""
    trainer = Trainer(cfg)
    trainer.run()
    idx = torch.arange(2 * 16).reshape(2, 16) % VOCAB
    trainer.model.eval()
    with torch.no_grad():
        return comm.all_gather(trainer.model(idx), -1, trainer.ps.tp_group)[..., :VOCAB]


@pytest.mark.parametrize("fsdp", ["on", "zero3"])
def test_training_ends_with_a_hugging_face_export(ranks, tmp_path, fsdp):
    import transformers
    hf_dir = save_tiny_hf("gpt2", str(tmp_path / "gpt2"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        f.write("{}")  # stands for the source's tokenizer files, which the export copies
    out = str(tmp_path / "export")
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=2, fsdp=fsdp,
                      model={"init_from": hf_dir}, checkpoint={"export_hf": out}, train={"steps": 2})
    logits = ranks(4).run(train_and_export_body, cfg)[0]
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = hf(torch.arange(2 * 16).reshape(2, 16) % VOCAB).logits
    assert (logits - want).abs().max().item() < 1e-4
