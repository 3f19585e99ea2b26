"""LoRA across processes: each generator process builds the frozen base once, pushes carry the adapters only.

The base is never pushed. The controller tells each generator process where the trainer's base came from
(``base_source``): ``model.path`` (read straight onto the generator's base shardings, as the trainer reads
it onto its own) or ``model.init_seed`` (the same random init). The generator casts it along the trainer's
chain (load dtype -> ``model.lora.base_dtype`` -> the generator dtype) and replies with a fingerprint: the
per-leaf push checksums (``transfer.checksum_fn``: position-weighted sums of the raw bits, independent of
the sharding) of its base. The controller computes the same over its own base cast to the generator dtype
and refuses any difference (``check_base``: one line naming the generator and the first differing leaf,
``LoraBaseMismatch``, a user error: exit 2). From then on every push is the adapter leaves only, through
the same transfer plan, checksums and disk fallback as full weights (``TransferPusher(select=adapters)``);
the generator hands its engine ``base + adapters`` (``model.lora.decode="unmerged"``) or a fresh merged copy
``W + (alpha/r) A B`` computed on its devices (``"merged"``; ``GeneratorLora.params``).

A base that exists only in the trainer (the SFT warm start trains it; a resume restores it from the
checkpoint) cannot be rebuilt by a generator: it travels ONCE, in the initial push (base + adapters, source
``"push"``, checksummed like every push), and the generator keeps it; the controller then re-plans the
pushes for the adapters only (``configure_push(..., stage="adapters")``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from jaxrl_async.cli.common import UserError

__all__ = ["LoraBaseMismatch", "base_source", "trainer_base_fingerprint", "check_bases", "check_base", "GeneratorLora"]


class LoraBaseMismatch(UserError):
    """A generator process's base is not bitwise the trainer's (one line: the generator and the leaf)."""


def base_source(cfg: Any, model_cfg: Any) -> dict[str, Any]:
    """How a generator process rebuilds the trainer's frozen base (picklable; sent in ``init``)."""
    lora = model_cfg.lora
    gen = {"model_config": model_cfg.replace(param_dtype=model_cfg.dtype), "decode": lora.decode,
           "base_dtype": lora.base_dtype}
    if cfg.trainer.sft.steps > 0:  # the warm start trains the base: it exists in the trainer only
        return {**gen, "source": "push"}
    if cfg.model.path is not None:
        return {**gen, "source": "path", "path": os.path.abspath(cfg.model.path), "numerics": cfg.model.numerics()}
    return {**gen, "source": "seed", "init_seed": int(cfg.model.init_seed),
            "base_config": model_cfg.replace(param_dtype="float32", lora=None)}


def trainer_base_fingerprint(params: Any, dtype: Any) -> tuple[list[str], list[int]]:
    """(keys, per-leaf checksums) of the trainer's base in ``params`` cast to the generator ``dtype``."""
    import jax

    from jaxrl_async.distributed.transfer import checksums_async, host_checksums, tree_keys
    from jaxrl_async.models import lora

    base = lora.split(params)[1]
    cast = jax.jit(lambda xs: [x.astype(dtype) for x in xs])
    return tree_keys(base), host_checksums(checksums_async(cast(jax.tree.leaves(base))))


def check_bases(peers: Sequence[Any], infos: Sequence[Mapping[str, Any]], params: Any, dtype: Any,
                source: Mapping[str, Any]) -> str:
    """Every generator's base fingerprint (``init`` reply) equals the trainer's (``check_base``); returns the
    log line. Source "push": nothing to compare (the base comes with the initial push)."""
    if source["source"] == "push":
        return (f"LoRA: the base exists only here (SFT warm start): sent once with the initial push to "
                f"{len(peers)} generator(s); later pushes carry the adapters only")
    import jax

    keys, sums = trainer_base_fingerprint(params, jax.numpy.dtype(dtype))
    for p, info in zip(peers, infos):
        check_base(p.name, keys, sums, info["lora_base"])
    return (f"LoRA: {len(peers)} generator(s) built the base ({source['source']}; fingerprints of {len(keys)} leaves "
            "equal the trainer's); pushes carry the adapters only")


def check_base(name: str, keys: Sequence[str], sums: Sequence[int], got: Mapping[str, Any]) -> None:
    """LoraBaseMismatch unless generator ``name``'s base fingerprint ``got`` equals the trainer's."""
    if list(got["keys"]) != list(keys):
        raise LoraBaseMismatch(f"model.lora: {name} built a base with other leaves than the trainer's "
                               f"({len(got['keys'])} vs {len(keys)})")
    bad = [k for k, a, b in zip(keys, sums, got["checksums"]) if int(a) != int(b)]
    if bad:
        raise LoraBaseMismatch(f"model.lora: the base {name} built from {got['source']} differs from the trainer's "
                               f"in {len(bad)} of {len(keys)} leaves (first: {bad[0]}); every generator host must "
                               "see the same model.path")


class GeneratorLora:
    """Generator side: the base (built once, on the generator's base shardings), the adapters' shardings
    (what a push lands in) and the parameters handed to the engine for pushed adapters."""

    def __init__(self, spec: Mapping[str, Any], mesh: Any, engine_shardings: Any):
        import jax
        import jax.numpy as jnp

        from jaxrl_async.models import lora
        from jaxrl_async.models.shardings import model_shardings

        self.spec = dict(spec)
        self.decode = spec["decode"]
        cfg = spec["model_config"]  # with the LoRA spec, generator dtype
        self.lora_spec = cfg.lora
        full_sh = engine_shardings if self.decode == "unmerged" else model_shardings(cfg, mesh, "generator")
        self.adapter_shardings, base_sh = lora.split(full_sh)
        from jaxrl_async.models.transformer import param_shapes

        self.adapter_shapes = [tuple(x.shape) for x in jax.tree.leaves(lora.split(param_shapes(cfg))[0])]
        # the first push lands in: base + adapters when the base comes with it, else the adapters
        self.first_push_shardings = full_sh if spec["source"] == "push" else self.adapter_shardings
        self.engine_shardings = engine_shardings
        self._merge = (jax.jit(lambda a, b: lora.merge(lora.join(a, b), self.lora_spec), out_shardings=engine_shardings)
                       if self.decode == "merged" else None)
        self.base, self.load_s = None, 0.0
        t0 = time.perf_counter()
        if spec["source"] == "push":
            return
        if spec["source"] == "path":
            from jaxrl_async.models.hf_io import load_hf

            _, base = load_hf(spec["path"], lambda m: model_shardings(m, mesh, "generator"), **spec["numerics"])
        elif spec["source"] == "seed":
            from jaxrl_async.models.transformer import init_params

            base = init_params(spec["base_config"], jax.random.key(int(spec["init_seed"])))
        else:
            raise ValueError(f"model.lora: unknown base source {spec['source']!r}")
        chain = (jnp.dtype(spec["base_dtype"]), jnp.dtype(cfg.dtype))  # the trainer's storage dtype, then the push cast
        self.base = jax.jit(lambda b: jax.tree.map(lambda x: x.astype(chain[0]).astype(chain[1]), b),
                            out_shardings=base_sh)(base)
        del base
        self.load_s = time.perf_counter() - t0

    def fingerprint(self) -> dict[str, Any]:
        import jax

        from jaxrl_async.distributed.transfer import checksum_fn, tree_keys

        if self.base is None:
            return {"source": "push", "load_s": 0.0}
        where = self.spec["path"] if self.spec["source"] == "path" else f"model.init_seed={self.spec['init_seed']}"
        return {"keys": tree_keys(self.base), "checksums": checksum_fn(jax.tree.leaves(self.base)), "source": where,
                "load_s": self.load_s}

    def params(self, pushed: Any) -> Any:
        """The engine's parameters for a push: ``pushed`` is the adapters, or base + adapters the first time
        (source "push": the base is kept). Base + adapters, or the merged copy (new buffers)."""
        import jax

        from jaxrl_async.models import lora

        adapters = pushed
        if self.base is None:
            if set(pushed) == {"layers"} and all(lora.is_adapter_key(k) for k in pushed["layers"]):
                raise RuntimeError("model.lora: adapters pushed before the base (source 'push')")
            adapters, self.base = lora.split(pushed)
        if self._merge is None:
            return lora.join(adapters, self.base)
        merged = self._merge(adapters, self.base)
        jax.block_until_ready(merged)
        return merged
