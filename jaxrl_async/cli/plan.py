"""`python -m jaxrl_async.plan --config FILE [--devices N] [--platform cpu|native] [--layout NAME]
[--target KIND] [--headroom F] [--json] [--list] [key=value ...]`: will this run fit its hardware? A config whose
policy is Qwen2.5-VL goes to ``cli/plan_vl.py`` (the decoder's plan + the vision tower and the images; its flags).

The planner itself (what it compiles, how it counts, exit codes) is ``plan/planner.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from jaxrl_async.cli.common import cli_main, make_parser
from jaxrl_async.plan import planner
from jaxrl_async.plan.host import format_host_estimate, host_estimate
from jaxrl_async.plan.planner import (
    PlanError, configure_devices, default_num_devices, format_layouts, format_plan, load_plan_config, make_plan,
    plan_model_config,
)


def _parser() -> argparse.ArgumentParser:
    about = planner.__doc__.split("\n", 2)[2].strip()
    p = make_parser("python -m jaxrl_async.plan", "Will this run fit its hardware?\n\n" + about)
    p.add_argument("--config", help="config file (default: the embedded default run)")
    p.add_argument("--devices", type=int, default=None, help="number of (simulated) devices; default: the layout's")
    p.add_argument("--platform", choices=("cpu", "native"), default="cpu",
                   help="cpu: simulated CPU devices; native: this machine's accelerators")
    p.add_argument("--layout", default=None, help="replace the mesh section with this layout (jaxrl_async.config.layouts)")
    p.add_argument("--target", default=None, help="device kind to budget against (default: the layout's)")
    p.add_argument("--headroom", type=float, default=0.10, help="share of device memory kept free")
    p.add_argument("--compile-for", choices=("auto", "target", "cpu"), default="auto",
                   help="compile the trainer for the target device itself (libtpu / CUDA plugin, deviceless: extras "
                        "aot-tpu / aot-gpu), or on the CPU (float32 upper bound); auto = target when installed")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the layouts and device kinds, then exit")
    vl = p.add_argument_group("vision-language policies (Qwen2.5-VL: planned by cli/plan_vl.py)")
    vl.add_argument("--images-per-prompt", type=int, default=None, help="default: the file's IMAGE_BUDGET, else 1")
    vl.add_argument("--image-tokens", type=int, default=None, help="visual tokens per image (default 1280)")
    vl.add_argument("--layers", type=int, default=None, help="reduced decoder depth (compile checks)")
    vl.add_argument("--vision-depth", type=int, default=None, help="reduced vision depth (compile checks)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    return p



@cli_main("plan")
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)  # -h/--help: usage, the description and every default
    if args.list:
        print(format_layouts())
        return 0
    cfg = load_plan_config(args.config, args.layout, args.overrides)
    if cfg.model.model_type == "qwen2_5_vl" or cfg.model.is_vision_language():
        # a vision-language policy: the decoder's plan + the vision tower and the images (`plan/vl.py`); it also
        # takes --images-per-prompt / --image-tokens / --layers / --vision-depth
        from jaxrl_async.cli import plan_vl

        return plan_vl.main(argv)
    if unknown:
        raise PlanError(f"unknown option {unknown[0]!r} (see --help)")
    vl_flags = [f for f in ("images_per_prompt", "image_tokens", "layers", "vision_depth") if getattr(args, f) is not None]
    if vl_flags:
        raise PlanError(f"--{vl_flags[0].replace('_', '-')}: only for a vision-language policy (Qwen2.5-VL); "
                        f"{args.config or 'the embedded default'} is a text model")
    n = args.devices if args.devices is not None else default_num_devices(cfg)
    configure_devices(n, args.platform)
    report = make_plan(cfg, num_devices=n, target=args.target, headroom=args.headroom, compile_for=args.compile_for)
    here = None
    if args.platform == "cpu":  # and what the same run would need on this machine's CPU (plan/host.py), fitted to
        from jaxrl_async.config.machine import fit_to_machine  # it as `main` would (config/machine.py)

        here, _ = fit_to_machine(cfg, "cpu", 1, cores=os.cpu_count())
        report["this_machine"] = host_estimate(here, plan_model_config(here))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_plan(report))
        if "this_machine" in report:
            print(f"\nthe same run on this machine's CPU instead (as `main` fits it: {here.model.dtype}):\n"
                  + format_host_estimate(report["this_machine"], cores=os.cpu_count()))
    return {"fits": 0, "does not fit": 1, "undecided": 3}[report["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
