import filecmp
import os

import pytest
from transformers import AutoTokenizer

from jaxrl_async.data import EOS_TOKEN, PAD_TOKEN, build_tokenizer


def test_loads_offline_with_specials(arith_tok_dir):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(arith_tok_dir))
    tok = AutoTokenizer.from_pretrained(arith_tok_dir)
    assert len(tok) < 512
    # ids 0..2 are the specials in build order.
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TOKEN, 2)
    assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 0)
    assert tok.encode("1+1", add_special_tokens=True) == tok.encode("1+1", add_special_tokens=False)  # no BOS


def test_digits_are_single_tokens(arith_tok):
    ids = arith_tok.encode("1234567890", add_special_tokens=False)
    assert [arith_tok.decode([i]) for i in ids] == list("1234567890")
    ids = arith_tok.encode("37+58 = 95", add_special_tokens=False)
    assert [arith_tok.decode([i]) for i in ids if arith_tok.decode([i]).strip().isdigit()] == list("375895")
    # "boxed" is a learned merge (frequent in the built-in corpus).
    assert "boxed" in [arith_tok.decode([i]) for i in arith_tok.encode("\\boxed{95}", add_special_tokens=False)]


@pytest.mark.parametrize("text", ["What is 37+58?\n37+58 = 95\nThe answer is \\boxed{95}.",
                                  "(12-3)*4 = {36} héllo wörld 世界 \t tabs  and  spaces"])
def test_round_trip(arith_tok, text):
    assert arith_tok.decode(arith_tok.encode(text, add_special_tokens=False)) == text


def test_chat_template(arith_tok):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    text = arith_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    no_gen = arith_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    sys_text = arith_tok.apply_chat_template([{"role": "system", "content": "S"}] + msgs, tokenize=False,
                                             add_generation_prompt=True)
    assert sys_text == "<|im_start|>system\nS<|im_end|>\n" + text
    ids = arith_tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # two <|im_start|>, one <|im_end|>
    assert arith_tok.decode(ids) == text


def test_deterministic(tmp_path, arith_tok_dir):
    again = build_tokenizer(tmp_path / "again", kind="arithmetic")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(arith_tok_dir, name), os.path.join(again, name), shallow=False)


def test_bpe_kind(bpe_tok_dir):
    tok = AutoTokenizer.from_pretrained(bpe_tok_dir)
    assert len(tok) <= 600
    text = "Maya buys 4 packs of stickers. How many stickers does Maya have left?"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # merges learned from the corpus compress English text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_args(tmp_path):
    with pytest.raises(ValueError, match="corpus_texts"):
        build_tokenizer(tmp_path, kind="bpe")
    with pytest.raises(ValueError, match="< 512"):
        build_tokenizer(tmp_path, kind="arithmetic", vocab_size=600)
    with pytest.raises(ValueError, match="kind"):
        build_tokenizer(tmp_path, kind="wordpiece")
