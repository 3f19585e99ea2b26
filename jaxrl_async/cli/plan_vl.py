"""`python -m jaxrl_async.cli.plan_vl --config FILE [--images-per-prompt N] [--image-tokens N] [--layers N]
[--vision-depth N] [--devices N] [--layout NAME] [--target KIND] [--headroom F] [--compile-for auto|target|cpu]
[--json] [key=value ...]`: will this Qwen2.5-VL run fit its hardware? The decoder's plan (``plan/planner.py``) plus
what the vision tower and the images add (``plan/vl.py``). A config file may give ``IMAGE_BUDGET``
(``configs/qwen2_5_vl_7b.py``). Exit codes: 0 fits, 1 does not fit, 2 configuration or usage error."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Sequence

from jaxrl_async.cli.common import cli_main
from jaxrl_async.plan.planner import configure_devices, default_num_devices, load_plan_config


def _config_module_defaults(path: str | None) -> dict:
    if path is None:
        return {}
    spec = importlib.util.spec_from_file_location("_jaxrl_async_vl_plan_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(getattr(module, "IMAGE_BUDGET", {}) or {})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxrl_async.cli.plan_vl", description=__doc__)
    p.add_argument("--config", required=True, help="run config file with a Qwen2.5-VL policy")
    p.add_argument("--images-per-prompt", type=int, default=None, help="default: the file's IMAGE_BUDGET, else 1")
    p.add_argument("--image-tokens", type=int, default=None, help="visual tokens per image (default 1280)")
    p.add_argument("--layers", type=int, default=None,
                   help="reduced depth: decoder layers (model.num_layers); compile checks, not a memory plan")
    p.add_argument("--vision-depth", type=int, default=None, help="reduced depth: vision blocks (compile checks)")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--layout", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--headroom", type=float, default=0.10)
    p.add_argument("--compile-for", choices=("auto", "target", "cpu"), default="auto")
    p.add_argument("--platform", choices=("cpu",), default="cpu",
                   help="simulated CPU devices (a VL plan compiles deviceless for its target)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    return p


@cli_main("plan_vl")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    defaults = _config_module_defaults(args.config)
    cfg = load_plan_config(args.config, args.layout, args.overrides)
    n = args.devices if args.devices is not None else default_num_devices(cfg)
    configure_devices(n, "cpu")
    from jaxrl_async.plan.vl import ImageBudget, format_vl_plan, make_vl_plan, reduced_run_depth

    cfg = reduced_run_depth(cfg, args.layers, args.vision_depth)
    budget = ImageBudget(args.images_per_prompt or defaults.get("images_per_prompt", 1),
                         args.image_tokens or defaults.get("tokens_per_image", 1280))
    r = make_vl_plan(cfg, budget, num_devices=n, target=args.target, headroom=args.headroom,
                     compile_for=args.compile_for)
    print(json.dumps(r, indent=2, default=str) if args.json else format_vl_plan(r))
    return 0 if r["vl"]["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
