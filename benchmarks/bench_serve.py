"""The OpenAI-compatible server (`python -m jaxrl_async.serve`) against the `generate` CLI on the same prompts.

    python benchmarks/bench_serve.py [--clients 64] [--max-tokens 64] [--hidden 256] [--layers 4] [--json out.json]

One process builds a small Qwen3-shaped model with a local tokenizer and chat template, starts the real server as
its own process (`--max-concurrent` = clients), waits for `/health`, then measures with `httpx` (one connection
per client):

* latency at 1 client: 16 chat completions one after another; p50 / p99 of the request's wall time;
* latency at C clients: C requests at once, twice; p50 / p99;
* throughput at C streaming clients: C streamed chat completions at once, completion tokens / wall time of the
  whole batch (first byte to last);
* the `generate` CLI on the same C prompts (the same chat rendering, `--max-concurrent` C): its own "decode
  tok/s" and tokens / its generate-phase wall time, measured in the same run after the server stopped.

Every request samples at temperature 1 with `ignore_eos` so all produce `--max-tokens` tokens; seeds differ per
client. The server and `generate` use float32 (a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_model(d: str, hidden: int, layers: int) -> None:
    from transformers import AutoTokenizer

    from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

    make_tiny_hf_model(d, "qwen3", vocab_size=512, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                       num_key_value_heads=max(hidden // 128, 1), head_dim=64, max_position_embeddings=2048)
    make_tiny_tokenizer(d, vocab_size=512)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def one(client, url: str, content: str, seed: int, max_tokens: int, stream: bool) -> tuple[float, int]:
    body = {"model": "bench", "messages": [{"role": "user", "content": content}], "temperature": 1.0,
            "max_tokens": max_tokens, "seed": seed, "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0, len(r.json()["choices"][0]["token_ids"])
    n = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    n += len(ch.get("token_ids") or [])
    return time.perf_counter() - t0, n


async def measure(url: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx

    out = {}
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await one(client, url, prompts[0], 0, max_tokens, False)  # warm (compiles are ahead of time; first-use paths)
        lat = [(await one(client, url, prompts[i % len(prompts)], i, max_tokens, False))[0] for i in range(16)]
        out["one_client"] = {"p50_s": statistics.median(lat), "p99_s": pct(lat, 0.99), "requests": len(lat)}
        lat = []
        for rnd in range(2):
            res = await asyncio.gather(*[one(client, url, p, 1000 * rnd + i, max_tokens, False)
                                         for i, p in enumerate(prompts)])
            lat += [r[0] for r in res]
        out["many_clients"] = {"clients": len(prompts), "p50_s": statistics.median(lat), "p99_s": pct(lat, 0.99)}
        t0 = time.perf_counter()
        res = await asyncio.gather(*[one(client, url, p, 5000 + i, max_tokens, True) for i, p in enumerate(prompts)])
        wall = time.perf_counter() - t0
        toks = sum(r[1] for r in res)
        out["streaming"] = {"clients": len(prompts), "tokens": toks, "wall_s": wall, "tok_s": toks / wall}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_serve_")
    model = os.path.join(tmp, "model")
    make_model(model, args.hidden, args.layers)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    prompts = [" ".join(words[(i + j) % 8] for j in range(3 + i % 13)) for i in range(args.clients)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen([sys.executable, "-m", "jaxrl_async.serve", "--model", model, "--port", str(port),
                               "--served-model-name", "bench", "--max-concurrent", str(args.clients),
                               "--max-model-len", "512"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stdout.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 600 s")
            time.sleep(0.5)
        res = asyncio.run(measure(url, prompts, args.max_tokens))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    # the generate CLI on the same prompts (the same chat rendering), after the server stopped
    inp, outp = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    t0 = time.perf_counter()
    gen = subprocess.run([sys.executable, "-m", "jaxrl_async.generate", "--model", model, "--input", inp, "--output",
                          outp, "--max-new-tokens", str(args.max_tokens), "--ignore-eos", "--temperature", "1",
                          "--max-concurrent", str(args.clients)], capture_output=True, text=True, env=env)
    whole = time.perf_counter() - t0
    if gen.returncode:
        raise SystemExit(gen.stderr[-2000:])
    m = re.search(r"tokens in ([\d.]+) s after .*decode ([\d.]+) tok/s", gen.stderr)
    toks = sum(len(json.loads(line)["completion_ids"]) for line in open(outp))
    res["generate_cli"] = {"tokens": toks, "generate_s": float(m.group(1)) if m else None,
                           "tok_s": toks / float(m.group(1)) if m else None,
                           "decode_tok_s": float(m.group(2)) if m else None, "whole_process_s": whole}
    res["ratio_streaming_vs_generate"] = (res["streaming"]["tok_s"] / res["generate_cli"]["tok_s"]
                                          if res["generate_cli"]["tok_s"] else None)
    res.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), clients=args.clients,
               max_tokens=args.max_tokens, model=dict(hidden=args.hidden, layers=args.layers, vocab=512))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
