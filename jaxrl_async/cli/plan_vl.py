"""`python -m jaxrl_async.cli.plan_vl --config FILE [--vl-model NAME] [--images-per-prompt N] [--image-tokens N]
[--devices N] [--target KIND] [--headroom F] [--compile-for auto|target|cpu] [--json] [key=value ...]`: will this
Qwen2.5-VL run fit its hardware? The decoder's plan (``plan/planner.py``) plus what the vision tower and the images
add (``plan/vl.py``). A config file may name ``VL_MODEL`` and ``IMAGE_BUDGET`` (``configs/qwen2_5_vl_7b.py``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Sequence

from jaxrl_async.cli.common import cli_main
from jaxrl_async.plan.planner import PlanError, configure_devices, default_num_devices, load_plan_config


def _config_module_defaults(path: str | None) -> dict:
    if path is None:
        return {}
    spec = importlib.util.spec_from_file_location("_jaxrl_async_vl_plan_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = dict(getattr(module, "IMAGE_BUDGET", {}) or {})
    if hasattr(module, "VL_MODEL"):
        out["vl_model"] = module.VL_MODEL
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrl_async.cli.plan_vl", description=__doc__)
    p.add_argument("--config", required=True, help="run config file whose model section is the VL decoder")
    p.add_argument("--vl-model", default=None, help="VL preset (models/vl_presets.py; default: the file's VL_MODEL)")
    p.add_argument("--images-per-prompt", type=int, default=None, help="default: the file's IMAGE_BUDGET, else 1")
    p.add_argument("--image-tokens", type=int, default=None, help="visual tokens per image (default 1280)")
    p.add_argument("--layers", type=int, default=None,
                   help="reduced depth: decoder layers of the VL model AND the run (model.num_layers); compile checks")
    p.add_argument("--vision-depth", type=int, default=None, help="reduced depth: vision blocks (compile checks)")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--layout", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--headroom", type=float, default=0.10)
    p.add_argument("--compile-for", choices=("auto", "target", "cpu"), default="auto")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    return p


@cli_main("plan_vl")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    defaults = _config_module_defaults(args.config)
    overrides = list(args.overrides) + ([f"model.num_layers={args.layers}"] if args.layers is not None else [])
    cfg = load_plan_config(args.config, args.layout, overrides)
    n = args.devices if args.devices is not None else default_num_devices(cfg)
    configure_devices(n, "cpu")
    from jaxrl_async.models.vl_presets import reduced_depth, vl_preset
    from jaxrl_async.plan.vl import ImageBudget, format_vl_plan, make_vl_plan

    name = args.vl_model or defaults.get("vl_model")
    if name is None:
        raise PlanError("--vl-model: the config names no VL_MODEL; pass --vl-model NAME (models/vl_presets.py)")
    budget = ImageBudget(args.images_per_prompt or defaults.get("images_per_prompt", 1),
                         args.image_tokens or defaults.get("tokens_per_image", 1280))
    vl = reduced_depth(vl_preset(name), args.layers, args.vision_depth)
    r = make_vl_plan(cfg, vl, budget, num_devices=n, target=args.target, headroom=args.headroom,
                     compile_for=args.compile_for)
    print(json.dumps(r, indent=2, default=str) if args.json else format_vl_plan(r))
    return 0 if r["vl"]["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
