"""Data layer: local tokenizers, prompt datasets on grain (text, and rows with images for Qwen2.5-VL), built-in
formats, a synthetic arithmetic task.

The names below load on first use (PEP 562): importing one submodule (the CLIs' ``data.tokenizer``) does not import
grain and the dataset stack with it (~0.7 s of a `generate` process on a CPU)."""
import os as _os

from jaxrl_async.lazy_exports import lazy_exports as _lazy_exports

__getattr__, __dir__, __all__ = _lazy_exports(__name__, globals(), {
    "arithmetic": ("ArithmeticConfig", "ArithmeticProblem", "build_splits", "sft_example", "write_arithmetic_dataset"),
    "datasets": ("BOXED_INSTRUCTION", "DataFormatError", "DatasetConfig", "DataStats", "PromptDataset",
                 "PromptIterator", "PromptRecord", "iter_eval_batches", "load_prompt_dataset", "make_train_iterator",
                 "read_prompt_records", "shard_dataset"),
    "formats": ("FORMATS", "gsm8k_final_answer", "parse_row"),
    "images": ("ImageProcessorConfig", "VLPromptRecord", "batch_vision_inputs", "load_vl_prompt_dataset",
               "read_vl_prompt_records"),
    "tokenizer": ("CHAT_TEMPLATE", "EOS_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "build_tokenizer"),
}, submodules=True)

SAMPLES_DIR = _os.path.join(_os.path.dirname(__file__), "samples")
GSM8K_SAMPLE_PATH = _os.path.join(SAMPLES_DIR, "gsm8k_sample.jsonl")
__all__ += ["SAMPLES_DIR", "GSM8K_SAMPLE_PATH"]
