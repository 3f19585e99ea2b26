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

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

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

# Qwen2.5-VL's chat template (the checkpoints' chat_template.json): Qwen's default system turn; a message's content
# is a string or a list of parts, each image part rendered <|vision_start|><|image_pad|><|vision_end|> (the
# processor then repeats <|image_pad|> once per image token: data/images.py)
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

KINDS = ("arithmetic", "bpe", "arithmetic_vl")
# the special tokens of Qwen2.5-VL's prompts ("arithmetic_vl" adds them after the arithmetic vocabulary)
VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
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
      kind: "arithmetic", "bpe" or "arithmetic_vl" (the arithmetic tokenizer plus Qwen2.5-VL's vision special
        tokens, :data:`VL_SPECIAL_TOKENS`, and its chat template, for vision-language policies).
      model_max_length: stored in tokenizer_config.json.
    """
    from transformers import PreTrainedTokenizerFast

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind in ("arithmetic", "arithmetic_vl"):
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
        additional_special_tokens=[IM_START] + (list(VL_SPECIAL_TOKENS) if kind == "arithmetic_vl" else []),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = QWEN2_5_VL_CHAT_TEMPLATE if kind == "arithmetic_vl" else CHAT_TEMPLATE
    hf.padding_side = "left"
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return out_dir


# -- a model directory's tokenizer and stop ids (shared by the run and every command-line tool) ---------------
class TokenizerFilesError(ValueError):
    """A model directory's generation files cannot be read (a user error: one line naming the file)."""


# Files that make a directory a tokenizer directory (a model saved by `save_pretrained` has none of them;
# `AutoTokenizer.from_pretrained` would then invent an empty tokenizer whose EOS id is 0).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def is_real_tokenizer(tokenizer: Any) -> bool:
    """False for None and for the empty tokenizer that `AutoTokenizer.from_pretrained` invents for a
    directory without tokenizer files (its only tokens are special ones, e.g. an EOS with id 0)."""
    if tokenizer is None:
        return False
    try:
        return len(tokenizer) > len(set(getattr(tokenizer, "all_special_ids", ()) or ()))
    except TypeError:  # not sized: trust it
        return True


def generation_eos_ids(path: str) -> list[int]:
    """EOS ids of ``path/generation_config.json`` ([] when there is none)."""
    f = os.path.join(path, "generation_config.json")
    if not os.path.isfile(f):
        return []
    try:
        with open(f, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise TokenizerFilesError(f"{f}: cannot read ({e})") from None
    if eos is None:
        return []
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]


def stop_token_ids(cfg: Any, tokenizer: Any = None, model_dir: str | None = None) -> tuple[int, ...]:
    """EOS ids generation stops at: the model config's (`eos_token_id`, an int or a list), those of
    `model_dir/generation_config.json` when a directory is given, and the tokenizer's EOS when it is a
    real tokenizer (see `is_real_tokenizer`)."""
    ids: set[int] = set()
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if model_dir is not None:
        ids.update(generation_eos_ids(model_dir))
    if is_real_tokenizer(tokenizer) and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(int(i) for i in ids))


def chat_template_wanted(tool: str, tokenizer: Any, path: str, enabled: bool) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template: by default yes when it has one; a
    tokenizer without one falls back to raw text with a one-line note."""
    if not enabled or tokenizer is None:
        return False
    if getattr(tokenizer, "chat_template", None):
        return True
    print(f"{tool}: note: the tokenizer in {path} has no chat template; prompts are used as raw text", file=sys.stderr,
          flush=True)
    return False
