"""Assistant masks under the families' own chat templates (Qwen2.5's, Qwen3's with its think
markup, Mistral Nemo's, Llama 3.2's; tests/fixtures/templates/ holds them as the models ship them): the supervised
tokens of a rendered row are exactly each assistant turn's content plus the turn's end token
(<|im_end|> for Qwen, </s> for Mistral, <|eot_id|> for Llama 3 -- the published formats, named here, not looked up
by the code under test), and the rest of the rendering is prompt."""
import json
from pathlib import Path

import pytest

from fixtures.synthetic import hf_tokenizer_json, tiny_bpe
from vkdsl.models import Tokenizer
from vkdsl.train.data import IGNORE, DataError, encode_row

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
# family -> (template file, extra special tokens, bos, eos, the end-of-turn token)
FAMILIES = {
    "qwen2.5": ("qwen2.5.jinja", [], None, "<|im_end|>", "<|im_end|>"),
    "qwen3": ("qwen3.jinja", ["<think>", "</think>"], None, "<|im_end|>", "<|im_end|>"),
    "qwen3-base": ("qwen3.jinja", ["<think>", "</think>"], None, "<|endoftext|>", "<|im_end|>"),
    "mistral-nemo": ("mistral-nemo.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
    "llama3.2": ("llama3.2.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                 "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
}
ROW = {"messages": [{"role": "system", "content": "Answer with one word."},
                    {"role": "user", "content": "Is it down?"}, {"role": "assistant", "content": "high"},
                    {"role": "user", "content": "And the dark mode request?"},
                    {"role": "assistant", "content": "low, it can wait"}]}


def tokenizer(tmp_path, family) -> Tokenizer:
    name, extra, bos, eos, _ = FAMILIES[family]
    vocab = tiny_bpe()
    tj = hf_tokenizer_json(vocab)
    for i, t in enumerate(extra):
        tj["added_tokens"].append({"id": len(vocab.tokens) + i, "content": t, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    tj["model"]["vocab"].update({t: len(vocab.tokens) + i for i, t in enumerate(extra)})
    d = tmp_path / family
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos,
                                                         "chat_template": (TEMPLATES / name).read_text()}))
    return Tokenizer.from_hf(d)


def supervised(ex):
    return [t for t in ex.labels if t != IGNORE]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_supervised_tokens_are_the_replies_and_their_end_of_turn(tmp_path, family):
    tok = tokenizer(tmp_path, family)
    end = tok.token_to_id(FAMILIES[family][4])
    assert tok.end_of_turn_id == end
    ex = encode_row(ROW, tok, True, 512, "left", "row 1")
    want = []
    for m in ROW["messages"]:
        if m["role"] == "assistant":
            want += tok.encode(m["content"], add_special=False) + [end]
    assert supervised(ex) == want
    # the tokens are the template's whole rendering, unchanged
    assert tok.decode(ex.ids) == tok.apply_chat_template(ROW["messages"], add_generation_prompt=False)
    # what the model is asked to continue from at the first reply is the template's own markup
    p0 = next(i for i, t in enumerate(ex.labels) if t != IGNORE)
    head = tok.decode(ex.ids[:p0 + 1])
    assert head.endswith({"qwen2.5": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n",
                          "qwen3-base": "<|im_start|>assistant\n", "mistral-nemo": "[/INST]",
                          "llama3.2": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[family])


@pytest.mark.parametrize("family", ["qwen3", "qwen3-base"])
def test_qwen3_think_markup_is_prompt(tmp_path, family):
    tok = tokenizer(tmp_path, family)
    ex = encode_row({"prompt": "Is it down?", "completion": "high"}, tok, True, 512, "left", "row 1")
    assert supervised(ex) == tok.encode("high", add_special=False) + [tok.token_to_id("<|im_end|>")]
    p0 = next(i for i, t in enumerate(ex.labels) if t != IGNORE)
    # the last reply renders after an empty think block; the model is given it, not taught it
    assert tok.decode(ex.ids[:p0 + 1]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_reply_the_template_rewrites_is_refused(tmp_path):
    tok = tokenizer(tmp_path, "qwen3")
    row = {"prompt": "Is it down?", "completion": "<think>\nthe site is up\n</think>\n\nlow"}
    with pytest.raises(DataError, match=r"row 7: the chat template rewrites an assistant turn's content"):
        encode_row(row, tok, True, 512, "left", "row 7")


def test_the_default_system_prompt_of_qwen25_is_prompt(tmp_path):
    tok = tokenizer(tmp_path, "qwen2.5")
    ex = encode_row({"prompt": "Is it down?", "completion": "high"}, tok, True, 512, "left", "row 1")
    assert "You are Qwen, created by Alibaba Cloud" in tok.decode(ex.ids)
    assert supervised(ex) == tok.encode("high", add_special=False) + [tok.token_to_id("<|im_end|>")]


def test_a_template_that_refuses_the_probe_ends_turns_at_eos(tmp_path):
    tok = tokenizer(tmp_path, "qwen2.5")
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    assert tok.end_of_turn_id == tok.eos_id == tok.token_to_id("<|im_end|>")
    tok.eos_id = tok.token_to_id("<|endoftext|>")          # the probe fails: EOS, whatever it is
    tok.chat_template += " "
    assert tok.end_of_turn_id == tok.eos_id
