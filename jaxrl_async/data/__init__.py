"""Data layer: local tokenizers, prompt datasets on grain (text, and rows with images for Qwen2.5-VL), built-in
formats, a synthetic arithmetic task."""
import os as _os

from jaxrl_async.data.arithmetic import (
    ArithmeticConfig,
    ArithmeticProblem,
    build_splits,
    sft_example,
    write_arithmetic_dataset,
)
from jaxrl_async.data.datasets import (
    BOXED_INSTRUCTION,
    DataFormatError,
    DatasetConfig,
    DataStats,
    PromptDataset,
    PromptIterator,
    PromptRecord,
    iter_eval_batches,
    load_prompt_dataset,
    make_train_iterator,
    read_prompt_records,
    shard_dataset,
)
from jaxrl_async.data.formats import FORMATS, gsm8k_final_answer, parse_row
from jaxrl_async.data.images import (
    ImageProcessorConfig,
    VLPromptRecord,
    batch_vision_inputs,
    load_vl_prompt_dataset,
    read_vl_prompt_records,
)
from jaxrl_async.data.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer

SAMPLES_DIR = _os.path.join(_os.path.dirname(__file__), "samples")
GSM8K_SAMPLE_PATH = _os.path.join(SAMPLES_DIR, "gsm8k_sample.jsonl")

__all__ = [
    "ArithmeticConfig", "ArithmeticProblem", "build_splits", "sft_example", "write_arithmetic_dataset",
    "BOXED_INSTRUCTION", "DataFormatError", "DatasetConfig", "DataStats", "PromptDataset", "PromptIterator",
    "PromptRecord", "iter_eval_batches", "load_prompt_dataset", "make_train_iterator", "read_prompt_records",
    "shard_dataset", "ImageProcessorConfig", "VLPromptRecord", "batch_vision_inputs", "load_vl_prompt_dataset",
    "read_vl_prompt_records", "FORMATS", "gsm8k_final_answer", "parse_row", "CHAT_TEMPLATE", "EOS_TOKEN", "PAD_TOKEN",
    "SPECIAL_TOKENS", "build_tokenizer", "SAMPLES_DIR", "GSM8K_SAMPLE_PATH",
]
