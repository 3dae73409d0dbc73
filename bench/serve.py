"""Load generator for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

Sends --num-prompts streaming requests (completions or chat) with random prompts and output lengths drawn from
uniform ranges, at a Poisson --request-rate (default: all at once) and under a --max-concurrency cap, and reports
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99) and throughput. The same script measures dsv4 and a
peer (vLLM, SGLang) on the same URL scheme.

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --input-len 512 --output-len 128 --range-ratio 0.25 --max-concurrency 32

Definitions (as vLLM's): TTFT from sending to the first chunk with text; ITL the gaps between chunks with text;
TPOT (e2e - TTFT) / (output tokens - 1) per request; token counts from the server's usage
(stream_options.include_usage). Prompts are random words, so their token count is what the server reports.
Output lengths are forced with `ignore_eos` (a vLLM extension dsv4 also accepts; --no-ignore-eos for servers
without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river stone light music garden window paper story water "
         "table energy market city night family answer letter friend mountain").split()


@dataclass
class Outcome:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(args) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    return [(" ".join(rng.choice(WORDS) for _ in range(length(args.input_len))), length(args.output_len))
            for _ in range(args.num_prompts)]


def payload(args, prompt: str, max_tokens: int) -> dict:
    body = {"model": args.model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def one(client: httpx.AsyncClient, args, prompt: str, max_tokens: int) -> Outcome:
    out = Outcome()
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload(args, prompt, max_tokens)) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return out
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = str(data["error"])[:200]
                    return out
                if data.get("usage"):
                    out.prompt_tokens = data["usage"]["prompt_tokens"]
                    out.output_tokens = data["usage"]["completion_tokens"]
                text = "".join((c.get("delta", {}).get("content") or c.get("delta", {}).get("reasoning_content")
                                or c.get("text") or "") for c in data.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
            out.e2e = time.perf_counter() - start
            out.output_tokens = out.output_tokens or chunks
            out.ok = chunks > 0
            out.error = "" if out.ok else "no text came back"
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run(args) -> tuple[list[Outcome], float]:
    requests = make_requests(args)
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=30)
    pool = httpx.Limits(max_connections=args.max_concurrency or len(requests))
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=pool) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def limited(prompt, max_tokens):
            async with limit:
                return await one(client, args, prompt, max_tokens)

        tasks, start = [], time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def report(args, outcomes: list[Outcome], duration: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ms = 1000.0

    def stats(values: list[float]) -> dict:
        v = np.array(values or [0.0]) * ms
        return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
                "p99": float(np.percentile(v, 99))}

    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    summary = {
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint, "num_prompts": len(outcomes),
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "completed": len(ok),
        "failed": len(outcomes) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(o.output_tokens for o in ok) / duration,
        "total_token_throughput": sum(o.prompt_tokens + o.output_tokens for o in ok) / duration,
        "total_input_tokens": sum(o.prompt_tokens for o in ok), "total_output_tokens": sum(o.output_tokens for o in ok),
        "ttft_ms": stats([o.ttft for o in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for o in ok for x in o.itl]), "e2el_ms": stats([o.e2e for o in ok]),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
    print(f"{' Serving benchmark ':=^60}")
    rows = [("Endpoint", f"{args.base_url} ({args.endpoint}, model {args.model})"),
            ("Successful / failed requests", f"{summary['completed']} / {summary['failed']}"),
            ("Request rate, max concurrency", f"{args.request_rate}, {args.max_concurrency or 'none'}"),
            ("Benchmark duration (s)", f"{duration:.2f}"),
            ("Total input / output tokens", f"{summary['total_input_tokens']} / {summary['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<34}{value}")
    print(f"{'(ms)':<10}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = summary[f"{name}_ms"]
        print(f"{name.upper():<10}" + "".join(f"{s[k]:>12.2f}" for k in ("mean", "p50", "p90", "p99")))
    for error in summary["errors"]:
        print(f"error: {error}")
    print("=" * 60)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: inf)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    p.add_argument("--input-len", type=int, default=256, help="prompt length in words (mean)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (mean)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers without vLLM's extensions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    args = p.parse_args(argv)
    outcomes, duration = asyncio.run(run(args))
    summary = report(args, outcomes, duration)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "outcomes": [asdict(o) for o in outcomes]}, f, indent=1)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
