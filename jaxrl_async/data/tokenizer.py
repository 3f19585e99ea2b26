"""Small local tokenizers in Hugging Face format (no downloads), with a Qwen-style chat template.

Two kinds, both byte-level BPE (any UTF-8 text round-trips: ``decode(encode(t)) == t``):

* ``"arithmetic"``: trained on a fixed synthetic arithmetic corpus (:func:`arithmetic.tokenizer_corpus`).
  Digits are isolated by a ``Digits(individual_digits=True)`` pre-tokenizer, so every digit is exactly one
  token (as in Qwen2's pre-tokenizer) and merges only form words/symbol runs (``boxed``, `` answer``...).
  Default vocab 384 (< 512).
* ``"bpe"``: the same pipeline trained on caller-supplied ``corpus_texts``.

Layout: ids 0..2 are the special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos),
then the 256 byte symbols, then merges. The saved directory holds ``tokenizer.json``,
``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``) and the chat template, so
``AutoTokenizer.from_pretrained(out_dir)`` works offline. Training is deterministic for a fixed corpus.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
PAD_TOKEN = ENDOFTEXT
EOS_TOKEN = IM_END

# Qwen2.5-style ChatML template (without Qwen's implicit default system message):
#   <|im_start|>{role}\n{content}<|im_end|>\n ... and, with add_generation_prompt, <|im_start|>assistant\n
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

KINDS = ("arithmetic", "bpe")
_BYTE_ALPHABET_SIZE = 256


def _train_tokenizer(texts: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    min_vocab = len(SPECIAL_TOKENS) + _BYTE_ALPHABET_SIZE
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (specials + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def build_tokenizer(
    out_dir: str | os.PathLike,
    corpus_texts: Sequence[str] | None = None,
    vocab_size: int | None = None,
    kind: str = "arithmetic",
    model_max_length: int = 4096,
) -> str:
    """Builds, saves and returns the path of a local HF tokenizer directory.

    Args:
      out_dir: directory to create/overwrite the tokenizer files in.
      corpus_texts: training texts. "arithmetic": optional extra texts appended to the built-in corpus;
        "bpe": required.
      vocab_size: target vocabulary size including specials (defaults: 384 arithmetic, 1024 bpe). The result
        may be smaller when the corpus has fewer frequent pairs.
      kind: "arithmetic" or "bpe".
      model_max_length: stored in tokenizer_config.json.
    """
    from transformers import PreTrainedTokenizerFast

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "arithmetic":
        from jaxrl_async.data.arithmetic import tokenizer_corpus

        texts = tokenizer_corpus() + list(corpus_texts or [])
        vocab_size = 384 if vocab_size is None else vocab_size
        if vocab_size >= 512:
            raise ValueError(f"arithmetic tokenizer vocab_size must be < 512, got {vocab_size}")
    else:
        if not corpus_texts:
            raise ValueError("kind='bpe' needs a non-empty corpus_texts")
        texts = list(corpus_texts)
        vocab_size = 1024 if vocab_size is None else vocab_size
    raw = _train_tokenizer(texts, vocab_size)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.padding_side = "left"
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return out_dir
