"""`python -m jaxrl_async.serve`: an OpenAI-compatible HTTP server on the continuous-batching generator.

    python -m jaxrl_async.serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]
        [--served-model-name NAME] [--max-concurrent N] [--max-model-len L] [--max-queue Q]
        [--dtype float32|bfloat16] [--request-timeout S] [--page-size P] [--num-pages N]
        [--max-top-logprobs K] [--no-warmup]

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (OpenAI's request and response
formats, `stream` as server-sent events), GET /health. Concurrent requests share the decode batch of
--max-concurrent slots; up to --max-queue more samples wait for a slot, beyond that a request gets 429.
Every response also carries the prompt and completion token ids, the behaviour log-probs of the tokens
and their policy version (`jaxrl_async/serve/app.py`); chat `top_logprobs` and completions `logprobs` give up to
--max-top-logprobs alternatives per token (default 20, OpenAI's largest; 0 leaves them out of the compiled
step). Prompts: chat messages are rendered by the
tokenizer's chat template (with `tools`), exactly as `generate` renders a one-message prompt; Qwen's
`<tool_call>{...}</tool_call>` output is returned as `tool_calls`.

Security: binds 127.0.0.1 by default; another address needs --api-key (or $JAXRL_ASYNC_API_KEY), which
every /v1 request must then send as `Authorization: Bearer KEY`.

Needs the `serve` extra (FastAPI, uvicorn): pip install 'jaxrl_async[serve]'.

Exit status: 0 stopped (Ctrl-C); 2 a user error (bad flag, model directory, missing extra: one line on
stderr naming it); 1 an internal error.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
import time

from jaxrl_async.cli.common import (UserError, cli_main, has_tokenizer_files, load_model, load_tokenizer, make_parser,
                                    model_config, note, note_cpu_bfloat16)
from jaxrl_async.serve.protocol import MAX_TOP_LOGPROBS  # (the standard library only)

TOOL = "serve"
API_KEY_ENV = "JAXRL_ASYNC_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_serve_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the server needs {' and '.join(missing)}: pip install 'jaxrl_async[serve]'")


def build_parser():
    ap = make_parser("python -m jaxrl_async.serve", __doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors + tokenizer)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (another than a loopback one needs --api-key)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"key every /v1 request must send as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model's base name)")
    ap.add_argument("--max-concurrent", type=int, default=16, help="decode slots: samples generated at once")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + completion (default: the model's max_position_embeddings, at most 4096)")
    ap.add_argument("--max-queue", type=int, default=256, help="samples that may wait for a slot (more: 429)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may take, queue included (then it is aborted and answered 504)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/param/KV dtype")
    ap.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pages (default: sized from the free memory; on a CPU the host's available RAM)")
    ap.add_argument("--max-top-logprobs", type=int, default=MAX_TOP_LOGPROBS,
                    help=f"most top_logprobs (chat) / logprobs (completions) a request may ask for, in [0, "
                         f"{MAX_TOP_LOGPROBS}] (each decode step computes this many alternatives per token; 0: none)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="compile at the first requests instead of before serving")
    ap.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level")
    return ap


@cli_main(TOOL)
def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, lo in (("max_concurrent", 1), ("max_queue", 0), ("page_size", 1), ("port", 0)):
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be >= {lo}")
    if args.port > 65535:
        ap.error("--port must be <= 65535")
    if not 0 <= args.max_top_logprobs <= MAX_TOP_LOGPROBS:
        ap.error(f"--max-top-logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {args.max_top_logprobs}")
    for name in ("max_model_len", "num_pages"):
        if getattr(args, name) is not None and getattr(args, name) < 2:
            ap.error(f"--{name.replace('_', '-')} must be >= 2")
    if not args.request_timeout > 0:
        ap.error("--request-timeout must be > 0")
    if args.api_key is not None and not args.api_key:
        ap.error("--api-key must not be empty")
    if not is_loopback(args.host) and args.api_key is None:
        raise UserError(f"--host {args.host} is not a loopback address: anyone who can reach it could use the model; "
                        f"set --api-key (or ${API_KEY_ENV}), or bind 127.0.0.1")
    require_serve_extra()
    from jaxrl_async.cli import compile_cache

    compile_cache.enable()
    note_cpu_bfloat16(TOOL, "--dtype bfloat16", args.dtype)
    cfg = model_config("--model", args.model, dtype=args.dtype, param_dtype=args.dtype)
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_len > cfg.max_position_embeddings:
        raise UserError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    tokenizer = load_tokenizer("--model", args.model) if has_tokenizer_files(args.model) else None
    if tokenizer is None:
        note(TOOL, f"{args.model} has no tokenizer files: only /v1/completions with token-id prompts is served")
    elif not getattr(tokenizer, "chat_template", None):
        note(TOOL, f"the tokenizer in {args.model} has no chat template: /v1/chat/completions answers 400")

    import uvicorn

    from jaxrl_async.data.tokenizer import stop_token_ids
    from jaxrl_async.generator.factory import CLI_FLAGS, EngineConfig, build_engine
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.serve.app import build_app
    from jaxrl_async.serve.backend import ServeBackend

    cfg, params = load_model("--model", args.model, cfg=cfg)
    spec = EngineConfig(max_concurrent_decodes=args.max_concurrent, max_sequence_length=max_len,
                        page_size=args.page_size, num_pages=args.num_pages, max_top_logprobs=args.max_top_logprobs)
    engine = build_engine(spec, cfg, fields=CLI_FLAGS)
    params = engine.place_params(params)
    if args.warmup:
        t0 = time.perf_counter()
        engine.warmup(params, truncation=True)
        note(TOOL, f"compiled in {time.perf_counter() - t0:.1f} s")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    gen = Generator(engine, params, tokenizer=tokenizer)
    with gen:
        backend = ServeBackend(gen, tokenizer, model_name=name, vocab_size=cfg.vocab_size,
                               eos_ids=stop_token_ids(cfg, tokenizer, args.model), max_queue=args.max_queue,
                               request_timeout_s=args.request_timeout)
        app = build_app(backend, api_key=args.api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_keep_alive=30, timeout_graceful_shutdown=10))
        print(f"{TOOL}: serving {name!r} ({args.max_concurrent} slots, context {max_len}) on http://{args.host}:"
              f"{args.port}/v1", file=sys.stderr, flush=True)
        server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
