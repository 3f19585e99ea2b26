"""`python -m jaxrl_async.main [--config FILE] [--print-config] [--dry-run] [key=value ...]`: run RL.

Without ``--config`` the embedded default runs (``jaxrl_async/config/default.py``: a tiny policy
learning arithmetic on a laptop CPU in about three minutes; 184 s measured on a 2-core CPU shared with
other jobs). Any field can be overridden with a dotted key (``trainer.lr=1e-6
rollout.max_head_offpolicyness=4``); a wrong key, type or combination stops the run before anything
is compiled, with a message naming the field.

Options:
  --config FILE    Python file with get_config() -> RunConfig (default: the embedded default)
  --print-config   print the resolved configuration to stderr before the run (default: off; it is
                   always written to RUN/config.json)
  --dry-run        validate and print the configuration to stdout, then exit (default: off); on a
                   CPU also what the run needs on this machine
  key=value        override one config field (default values: see --dry-run)

A config whose ``mesh.layout`` names GPU/TPU hardware runs on a CPU-only machine as well, and
``mesh.layout=auto`` on any machine: the mesh and the settings that belong to the machine (dtype, KV pool,
micro-batch tokens, reward workers) are fitted to it, one line per change (``jaxrl_async/config/machine.py``).

Stops: SIGTERM/SIGINT (Ctrl-C) at any moment end the run in order and exit 0: the current warm-start
or RL step finishes and is checkpointed (the embedded default also saves every 5 RL steps and every
30 s), and the last line says what was saved; the same command resumes from it. A second signal exits
at once without saving.

Exit codes: 0 = completed, or stopped by SIGTERM/SIGINT/max_wall_time_s after saving a checkpoint;
2 = configuration error; 1 = the run failed (the message says why; a checkpoint was attempted).
"""

from __future__ import annotations

import logging
import os
import sys

from jaxrl_async.checkpoint import handle_signals
from jaxrl_async.cli.common import cli_main, error_line


def _configure_cpu_devices(n: int | None) -> None:
    """Simulated CPU devices, before JAX starts (only affects the CPU backend)."""
    if n is None or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    jax.config.update("jax_num_cpu_devices", int(n))


def _print_host_estimate(cfg) -> None:
    """On a CPU-only machine: what the run needs here (memory per role, a rough time per step; ``plan/host.py``)."""
    import jax

    if jax.default_backend() != "cpu":
        return
    from jaxrl_async.loop.setup import dry_run_model_config
    from jaxrl_async.plan.host import format_host_estimate, host_estimate

    print(format_host_estimate(host_estimate(cfg, dry_run_model_config(cfg)), cores=os.cpu_count()))


@cli_main("main", handle_interrupt=False)  # user errors (config, model files, data rows): one line, exit 2
@handle_signals  # SIGTERM/SIGINT from here on: every phase of the run stops in order (one line, exit 0)
def main(argv: list[str] | None = None) -> int:
    from jaxrl_async.config import ConfigError, format_config, parse_command_line, peek_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from jaxrl_async.config.machine import cpu_devices_before_start

    try:
        _configure_cpu_devices(cpu_devices_before_start(peek_config(argv)))
        from jaxrl_async.config.default import get_config

        cfg, flags = parse_command_line(argv, default_config=get_config(), fit_machine=True)
    except ConfigError as e:
        print(error_line("main", e), file=sys.stderr)
        return 2
    for line in flags["machine"]:  # what was fitted to this machine (config/machine.py), one line each
        print(f"[jaxrl_async] {line}", file=sys.stderr)
    if not flags["machine"]:  # a CPU config that asks for bfloat16 itself: kept, with the reason it is slow here
        from jaxrl_async.cli.common import note_cpu_bfloat16

        note_cpu_bfloat16("main", "model.dtype=bfloat16", cfg.model.dtype)
    if flags["dry_run"]:  # the dry run's output is its product: stdout (errors stay on stderr)
        print(format_config(cfg))
        print("config OK (dry run)")
        _print_host_estimate(cfg)
        return 0
    if flags["print_config"] or cfg.logging.print_config:  # a run's log, beside its progress: stderr
        print(format_config(cfg), file=sys.stderr)
    from jaxrl_async.cli import compile_cache
    from jaxrl_async.loop import FatalRunError, RLRun

    compile_cache.enable()
    try:
        result = RLRun(cfg).run()
    except FatalRunError as e:
        print(f"[jaxrl_async] run failed: {e}", file=sys.stderr)
        return 1
    line = result.final_line()  # the whole run's accuracy (warm start -> end) and its resumes
    if line:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
