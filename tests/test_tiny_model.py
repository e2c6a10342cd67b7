import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json

import pytest
import torch

from hybridflow.models.tiny import IM_END, IM_START, PAD_TOKEN, build_char_tokenizer, main_make_model, make_tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_char_tokenizer_round_trip(tok):
    text = "12 + 3 = 15\nHello, World! ~{}[]"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per char
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("12", add_special_tokens=False)) == "12"
    # every printable ASCII char and "\n" is a single distinct token
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    single = [tok.encode(c, add_special_tokens=False) for c in chars]
    assert all(len(s) == 1 for s in single)
    assert len({s[0] for s in single}) == len(chars)
    # non-ASCII text still round-trips exactly (byte fallback, no unknown tokens)
    assert tok.decode(tok.encode("é→x", add_special_tokens=False)) == "é→x"


def test_special_tokens_and_ids(tok):
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == IM_END
    assert tok.convert_tokens_to_ids([PAD_TOKEN, IM_START, IM_END]) == [0, 1, 2]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    ids = tok.encode(f"{IM_START}ab{IM_END}", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "3+5="}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\n3+5=<|im_end|>\n"


@pytest.mark.parametrize("arch,cls_name", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_make_model_save_reload_forward(tmp_path, tok, arch, cls_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=32, intermediate_size=64, seed=1)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rtok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == cls_name
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == 2 and model.config.pad_token_id == 0
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 2 and gen_cfg["pad_token_id"] == 0
    # reloaded tokenizer behaves exactly like the built one (qwen2 reloads as Qwen2Tokenizer)
    msgs = [{"role": "user", "content": "7+8="}]
    for t in ("12 + 3\n x", "a b  c\n\nd"):
        assert rtok.encode(t, add_special_tokens=False) == tok.encode(t, add_special_tokens=False)
        assert rtok.decode(rtok.encode(t, add_special_tokens=False)) == t
    a = rtok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert a == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rtok.pad_token_id == 0 and rtok.eos_token_id == 2
    # forward pass
    ids = torch.tensor([tok.encode("3+5=", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, len(tok))
    assert torch.isfinite(logits).all()
    # same seed -> same weights
    out2 = make_tiny_model(tmp_path / (arch + "2"), arch=arch, hidden_size=32, intermediate_size=64, seed=1)
    m2 = AutoModelForCausalLM.from_pretrained(out2, dtype=torch.float32)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_cli(tmp_path, capsys):
    assert main_make_model([str(tmp_path / "m"), "--arch", "llama", "--hidden-size", "32", "--layers", "1",
                            "--heads", "2", "--kv-heads", "1", "--seed", "3"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    assert cfg["num_key_value_heads"] == 1
    assert str(tmp_path / "m") in capsys.readouterr().out


def test_bad_arch(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, arch="gpt9")
