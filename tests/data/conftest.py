"""Shared fixtures: locally built tokenizers (once per session)."""
import pytest

from jaxrl_async.data import GSM8K_SAMPLE_PATH, build_tokenizer


@pytest.fixture(scope="session")
def arith_tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok_arith"), kind="arithmetic")


@pytest.fixture(scope="session")
def arith_tok(arith_tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_tok_dir)


@pytest.fixture(scope="session")
def bpe_tok_dir(tmp_path_factory):
    import json

    with open(GSM8K_SAMPLE_PATH) as f:
        corpus = [json.loads(line)["question"] for line in f]
    return build_tokenizer(tmp_path_factory.mktemp("tok_bpe"), corpus_texts=corpus, vocab_size=600, kind="bpe")
