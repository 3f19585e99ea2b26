"""Hugging Face checkpoint import and export.

Import (`load_hf`): reads `config.json`, memory-maps the safetensors files (single file or
sharded with `model.safetensors.index.json`), validates every tensor name and shape against
the mapping table (`hf_mapping.py`) *before* touching device memory, then builds each
parameter with `jax.make_array_from_callback` directly on its target sharding: every device
shard is cut from the memory-mapped file one layer at a time, so the host never holds a copy
of the whole model (peak host memory ~ one layer of one tensor kind plus one device shard).

Export (`save_hf`): parameters from any mesh -> `model.safetensors` (or `model-0000k-of-0000n`
shards plus an index above `max_shard_bytes`), `config.json`, `generation_config.json`, and the
tokenizer files when a tokenizer directory is known. Tied embeddings are written the way
transformers expects (no `lm_head.weight`, `tie_word_embeddings: true`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.hf_mapping import IGNORED_HF, Row, mapping
from jaxrl_async.models.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsReader, write_safetensors
from jaxrl_async.models.transformer import Params, param_shapes

# (+ a vision-language model's image processor settings, which travel with its tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "preprocessor_config.json")


class CheckpointMismatchError(ValueError):
    """The safetensors tensors do not match the architecture in config.json."""


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _tables(cfg: Any) -> tuple[list[Row], Params, dict[str, tuple[int, ...]]]:
    """(name table, parameter shapes, stack -> HF layer index of each slice) of a text `ModelConfig` or a
    vision-language `qwen2_5_vl.VLConfig` (its table: `hf_mapping_vl.py`)."""
    from jaxrl_async.models import qwen2_5_vl

    if qwen2_5_vl.is_vl(cfg):
        from jaxrl_async.models import hf_mapping_vl

        return hf_mapping_vl.mapping(cfg), qwen2_5_vl.param_shapes(cfg), hf_mapping_vl.layer_stacks(cfg)
    return mapping(cfg), param_shapes(cfg), cfg.layer_stacks()


def config_from_hf(model_dir: str, **policy) -> Any:
    """The config of a HF model directory: a `qwen2_5_vl.VLConfig` for ``model_type: qwen2_5_vl``, else a
    `ModelConfig` (its errors for unsupported architectures)."""
    from jaxrl_async.models import qwen2_5_vl

    path = os.path.join(model_dir, "config.json") if os.path.isdir(model_dir) else model_dir
    try:
        with open(path) as fh:
            mt = json.load(fh).get("model_type")
    except (OSError, ValueError):
        mt = None  # ModelConfig.from_hf names the problem
    if mt == qwen2_5_vl.MODEL_TYPE:
        return qwen2_5_vl.VLConfig.from_hf(model_dir, **policy)
    return ModelConfig.from_hf(model_dir, **policy)


def _layer_ids(row: Row, cfg: Any) -> tuple[int, ...]:
    """HF layer index of each slice of ``row``'s stacked array."""
    return _tables(cfg)[2][row.ours[0]]


def _hf_names(row: Row, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, index into our array) of every tensor of ``row``."""
    if row.per_expert:
        return [(row.hf.format(i=i, j=j), (s, j)) for s, i in enumerate(_layer_ids(row, cfg))
                for j in range(cfg.num_experts)]
    if row.per_layer:
        return [(row.hf.format(i=i), (s,)) for s, i in enumerate(_layer_ids(row, cfg))]
    return [(row.hf, ())]


def _expected_hf_shape(row: Row, cfg: ModelConfig, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = our_shape[2:] if row.per_expert else our_shape[1:] if row.per_layer else our_shape
    out = jax.eval_shape(lambda x: row.to_hf(x, cfg), jax.ShapeDtypeStruct(shape, jnp.float32))
    return tuple(out.shape)


def check_checkpoint(reader: SafetensorsReader, cfg: ModelConfig, source: str) -> None:
    """Raise one CheckpointMismatchError listing every missing, unexpected or mis-shaped tensor."""
    rows, shapes, _ = _tables(cfg)
    expected: dict[str, tuple[int, ...]] = {}
    for row in rows:
        our = tuple(_get(shapes, row.ours).shape)
        hf_shape = _expected_hf_shape(row, cfg, our)
        for n, _ in _hf_names(row, cfg):
            expected[n] = hf_shape
    present = set(reader.keys())
    missing = sorted(set(expected) - present)
    tolerated = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in present - set(expected)
                        if n not in tolerated and not any(n.endswith(s) for s in IGNORED_HF))
    wrong = sorted(f"{n}: file {reader.shape(n)} != expected {s}" for n, s in expected.items()
                   if n in present and tuple(reader.shape(n)) != s)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if wrong:
        problems.append(f"wrong shapes ({len(wrong)}): {'; '.join(wrong[:20])}")
    if problems:
        raise CheckpointMismatchError(f"{source}: checkpoint does not match its config "
                                      f"({cfg.model_type}, {cfg.num_layers} layers): " + " | ".join(problems))


def load_hf(model_dir: str, shardings: Any = None, cfg: ModelConfig | None = None, **policy) -> tuple[ModelConfig, Params]:
    """Load a HF model directory. Returns (cfg, params).

    shardings: a tree of Shardings matching the params (e.g. `sharding.model_shardings(cfg,
    mesh, "trainer")`), a callable cfg -> such a tree, or None for the default device.
    policy: ModelConfig overrides (dtype, param_dtype, remat, scan_layers).
    """
    if cfg is None:
        cfg = config_from_hf(model_dir, **policy)
    elif policy:
        cfg = cfg.replace(**policy)
    reader = SafetensorsReader.from_dir(model_dir)
    check_checkpoint(reader, cfg, model_dir)
    if callable(shardings):
        shardings = shardings(cfg)
    rows, shapes, _ = _tables(cfg)
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    default = SingleDeviceSharding(jax.devices()[0])
    params: Params = {}
    for row in rows:
        sd = _get(shapes, row.ours)
        sharding: Sharding = _get(shardings, row.ours) if shardings is not None else default
        _set(params, row.ours, _load_leaf(reader, row, cfg, tuple(sd.shape), sharding, dtype))
    return cfg, params


def _load_leaf(reader: SafetensorsReader, row: Row, cfg: ModelConfig, shape, sharding: Sharding, dtype):
    ids = _layer_ids(row, cfg) if row.per_layer else ()
    if row.per_expert:
        def cb(index):
            layers, experts = ids[index[0]], range(*index[1].indices(shape[1]))
            return np.stack([np.stack([
                np.asarray(row.to_ours(reader.get(row.hf.format(i=i, j=j)), cfg)[index[2:]]).astype(dtype)
                for j in experts]) for i in layers])
    elif row.per_layer:
        def cb(index):
            layers = ids[index[0]]
            parts = [np.asarray(row.to_ours(reader.get(row.hf.format(i=i)), cfg)[index[1:]]).astype(dtype)
                     for i in layers]
            return np.stack(parts)
    else:
        def cb(index):
            return np.asarray(row.to_ours(reader.get(row.hf), cfg)[index]).astype(dtype)
    return jax.make_array_from_callback(shape, sharding, cb)


def save_hf(params: Params, cfg: ModelConfig, out_dir: str, *, tokenizer_dir: str | None = None,
            dtype: str | None = None, max_shard_bytes: int = 2 * 2**30) -> list[str]:
    """Write a HF model directory; returns the written weight file names."""
    from jaxrl_async.models.lora import has_adapters

    if has_adapters(params):  # the mapping has no adapter rows: they would be dropped silently
        raise ValueError("save_hf: the parameters carry LoRA adapters; merge them (models.lora.merge) or export a "
                         "PEFT adapter directory (export.save_peft_adapter)")
    os.makedirs(out_dir, exist_ok=True)
    np_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    # Plan: (hf name, row, layer index or None, nbytes), grouped by row so one stacked tensor
    # kind at a time is gathered to host.
    plan = []
    for row in _tables(cfg)[0]:
        shape = tuple(_get(params, row.ours).shape)
        per = shape[2:] if row.per_expert else shape[1:] if row.per_layer else shape
        nbytes = int(np.prod(per, dtype=np.int64)) * np_dtype.itemsize
        for name, idx in _hf_names(row, cfg):
            plan.append((name, row, idx, nbytes))
    shards: list[list] = [[]]
    size = 0
    for item in plan:
        if shards[-1] and size + item[3] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[3]
    names = [SINGLE_NAME] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    cache: dict[tuple, np.ndarray] = {}
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for hf_name, row, i, _ in shard:
            if row.ours not in cache:
                cache.clear()
                cache[row.ours] = np.asarray(jax.device_get(_get(params, row.ours)))
            host = cache[row.ours]
            t = host[i] if i else host
            tensors[hf_name] = np.ascontiguousarray(row.to_hf(t, cfg)).astype(np_dtype)
            weight_map[hf_name] = fname
        write_safetensors(os.path.join(out_dir, fname), tensors)
    cache.clear()
    index_path = os.path.join(out_dir, INDEX_NAME)
    if len(shards) > 1:
        total = sum(item[3] for item in plan)
        with open(index_path, "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    elif os.path.exists(index_path):
        os.remove(index_path)
    hf_cfg = cfg.to_hf()
    hf_cfg["dtype"] = str(jnp.dtype(np_dtype))
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_cfg, fh, indent=2)
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("pad_token_id", cfg.pad_token_id),
                             ("eos_token_id", list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_id))
           if v is not None}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump(gen, fh, indent=2)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out_dir)
    return names


def copy_tokenizer(src_dir: str, out_dir: str) -> list[str]:
    copied = []
    if os.path.abspath(src_dir) == os.path.abspath(out_dir):
        return copied
    for f in TOKENIZER_FILES:
        p = os.path.join(src_dir, f)
        if os.path.exists(p):
            shutil.copy2(p, os.path.join(out_dir, f))
            copied.append(f)
    return copied
