"""Fixtures of the ``serve`` tests."""
from __future__ import annotations

import pytest
from serve_helpers import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The character-level tiny tokenizer (ids < 128) with the tests' Qwen-style chat template."""
    from transformers import AutoTokenizer

    from jaxrl_async.testing import make_tiny_tokenizer

    d = str(tmp_path_factory.mktemp("tok"))
    make_tiny_tokenizer(d, vocab_size=128)
    t = AutoTokenizer.from_pretrained(d)
    t.chat_template = CHAT_TEMPLATE
    return t
