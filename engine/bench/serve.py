"""python -m engine.bench serve: latency and throughput of any OpenAI-compatible server.

    python -m engine.bench serve --base-url http://127.0.0.1:8000 --model NAME \\
        --num-prompts 64 --input-len 128 --output-len 128 --ignore-eos --max-concurrency 16

Streams /v1/completions requests with random token-id prompts (exact input lengths without
a tokenizer) and measures what vLLM's `vllm bench serve` measures, with the same
definitions: TTFT (send -> first chunk with text), TPOT ((E2EL - TTFT) / (output tokens - 1),
requests with more than one output token), ITL (every gap between successive text chunks,
all requests pooled), E2EL (send -> last text chunk), and request and token throughputs
over the benchmark duration (first send -> last completion).

`--dataset FILE` sends conversations from a JSON-lines file (`{"messages": [...]}` a line,
e.g. tests/data/grounded_prompts.jsonl) to /v1/chat/completions instead (a `{"text": ...}`
line goes to --endpoint as a text prompt). When the server counts speculative decoding in
`/metrics` (xlaserve's or vLLM's `spec_decode_*` counters), the run reports what it drafted:
acceptance rate and mean accepted length. `--task embed` sends one text per request to
/v1/embeddings and measures texts and prompt tokens a second (engine/bench/serve_embed.py).
This module imports no jax: only the optional machine ceilings (engine.bench.ceilings) do, lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import sys
import time

import httpx
import numpy as np

from engine.bench.serve_report import print_table
from engine.bench.spec_metrics import spec_counters, spec_summary


@dataclasses.dataclass
class Request:
    prompt: list[int] | str | list[dict]  # token ids, text, or a chat's messages (--dataset)
    prompt_len: int | None  # None: a text prompt whose length only the server knows
    output_len: int


@dataclasses.dataclass
class Result:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with text
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


# Common English words, each one token (with its leading space) in the usual BPE vocabularies:
# random text prompts of about --input-len tokens for servers that take text only.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but "
    "one all were we when there can an which their said if will each about how up out them "
    "then she many some so these would other into has more two time could no way been people "
    "than first water who its now find long down day did get come made may part over new sound "
    "take only little work know place year live me back give most very after thing our just "
    "name good man think say great where help through much before line right too mean old any "
    "same tell boy follow came want show also around form three small set put end does another "
    "well large must big even such turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house point page "
    "letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye "
    "light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run").split()


def sample_requests(args, n: int, seed: int, prompt_len: int | None = None) -> list[Request]:
    """Lengths uniform in [len*(1-r), len]; token ids from [100, 10000), clear of special ids.
    With --prompt, every request sends that text (prompt_len: its length, when known).
    Embeddings always take text: a vocabulary's ids differ between models and servers add
    their special tokens ([CLS], [SEP]) to text only."""
    rng = random.Random(seed)
    if args.dataset:
        with open(args.dataset) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        prompts = [line["messages"] if "messages" in line else line["text"] for line in lines]
        first = rng.randrange(len(prompts))  # warmups start elsewhere than measured requests
        return [Request(prompts[(first + i) % len(prompts)], None, args.output_len)
                for i in range(n)]
    lo_in = max(1, int(args.input_len * (1 - args.range_ratio)))
    lo_out = max(1, int(args.output_len * (1 - args.range_ratio)))
    reqs = []
    for _ in range(n):
        n_in, n_out = rng.randint(lo_in, args.input_len), rng.randint(lo_out, args.output_len)
        if args.prompt is not None:
            reqs.append(Request(args.prompt, prompt_len, n_out))
        elif args.text_prompts or args.task == "embed":  # length from the server's usage
            text = " ".join(rng.choice(WORDS) for _ in range(n_in))
            reqs.append(Request(text, None, n_out))
        else:
            reqs.append(Request([rng.randrange(100, 10000) for _ in range(n_in)], n_in, n_out))
    return reqs


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request after the first; gamma gaps (burstiness 1 = Poisson)."""
    if rate == float("inf") or n == 0:
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def send(client: httpx.AsyncClient, args, req: Request) -> Result:
    chat = isinstance(req.prompt, list) and bool(req.prompt) and isinstance(req.prompt[0], dict)
    payload = {"model": args.model, "max_tokens": req.output_len,
               "temperature": args.temperature, "stream": True,
               "stream_options": {"include_usage": True},
               **({"messages": req.prompt} if chat else {"prompt": req.prompt})}
    endpoint = "/v1/chat/completions" if chat else args.endpoint
    if args.ignore_eos:
        payload |= {"ignore_eos": True, "min_tokens": req.output_len}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    approx = len(req.prompt.split()) if isinstance(req.prompt, str) else 0
    text_of = ((lambda c: (c.get("delta") or {}).get("content")) if chat
               else (lambda c: c.get("text")))
    res = Result(prompt_len=req.prompt_len or approx)
    usage_tokens = None
    for attempt in range(2):
        res.start = time.perf_counter()
        try:
            async with client.stream("POST", args.base_url.rstrip("/") + endpoint,
                                     json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {body[:500]}"
                    return res
                # Read to the end of the stream (past [DONE]) so the connection can be reused.
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue  # blank separators, SSE comments/pings, [DONE]
                    event = json.loads(line[5:])
                    if "error" in event:
                        res.error = f"error event: {json.dumps(event['error'])[:500]}"
                        return res
                    choices = event.get("choices")
                    if choices and text_of(choices[0]):
                        res.chunk_times.append(now)
                    if usage := event.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        res.prompt_len = usage.get("prompt_tokens") or res.prompt_len
        except httpx.RemoteProtocolError as e:
            # A kept-alive connection the server had closed (llama.cpp's server does so after
            # some streams): the request never reached it, so sending it again on a fresh
            # connection is safe, once.
            if attempt == 0 and not res.chunk_times:
                continue
            res.error = f"{type(e).__name__}: {e}"
            return res
        except Exception as e:  # a benchmark reports failures, it does not stop at them
            res.error = f"{type(e).__name__}: {e}"
            return res
        break
    if not res.chunk_times:
        res.error = "the stream carried no text chunk (no TTFT)"
        return res
    res.output_len = usage_tokens if usage_tokens is not None else len(res.chunk_times)
    res.success = True
    return res


async def tokenize_count(client: httpx.AsyncClient, args, text: str) -> int:
    """Prompt length from the server's /tokenize (vLLM: count; llama.cpp: tokens)."""
    base = args.base_url.rstrip("/").removesuffix("/v1")
    resp = await client.post(base + "/tokenize",
                             json={"model": args.model, "prompt": text, "content": text})
    resp.raise_for_status()
    body = resp.json()
    return body["count"] if "count" in body else len(body["tokens"])


def task_client(task: str):
    """How a task's requests are sent, summarised and printed: completions and chat here,
    embeddings in serve_embed."""
    if task == "embed":
        from engine.bench import serve_embed  # it imports this module, so not at the top

        return (serve_embed.send_embedding, serve_embed.summarize_embeddings,
                serve_embed.print_embedding_table)
    return send, summarize, print_table


async def benchmark(args) -> dict:
    """Warm up, then send the measured requests on schedule; returns the metrics."""
    send_one, summarize_run, _ = task_client(args.task)
    # The pool never makes a request wait: only the semaphore bounds what is in flight.
    pool = args.num_prompts + args.num_warmups
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0),
                                 limits=limits) as client:
        prompt_len = None
        if args.prompt is not None and args.tokenizer_endpoint:
            prompt_len = await tokenize_count(client, args, args.prompt)
        requests = sample_requests(args, args.num_prompts, args.seed, prompt_len)
        sem = asyncio.Semaphore(args.max_concurrency or pool)

        async def one(req: Request, send_at: float) -> Result:
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            async with sem:
                return await send_one(client, args, req)

        # Warmups use their own prompts so no measured prompt hits a warm prefix cache.
        warmups = sample_requests(args, args.num_warmups, args.seed + 1, prompt_len)
        warm = await asyncio.gather(*(one(r, 0.0) for r in warmups))
        if failed := [w.error for w in warm if not w.success]:
            raise RuntimeError(f"warmup request failed: {failed[0]}")
        offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
        spec_before = await spec_counters(client, args)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, t0 + o)
                                         for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - t0
        spec = spec_summary(spec_before, await spec_counters(client, args))
    return summarize_run(args, requests, results, duration) | spec


def latency_stats(name: str, values_s: list[float]) -> dict:
    ms = np.asarray(values_s or [0.0]) * 1000  # vLLM reports 0 for an empty set
    return {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(np.std(ms)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(args, requests: list[Request], results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_len for r in ok)
    return {
        "label": args.label or args.model, "base_url": args.base_url, "model": args.model,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **latency_stats("ttft", [r.ttft for r in ok]),
        **latency_stats("tpot", [(r.e2el - r.ttft) / (r.output_len - 1) for r in ok
                                 if r.output_len > 1]),
        **latency_stats("itl", [gap for r in ok for gap in r.itl]),
        **latency_stats("e2el", [r.e2el for r in ok]),
        # Per request, in send order (failed requests: 0 / empty), as vLLM's --save-result.
        "requested_output_lens": [q.output_len for q in requests],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "e2els": [r.e2el if r.success else 0.0 for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "errors": [r.error for r in results],
    }


def measure_best_ceilings(args, before: dict | None = None) -> dict:
    """Matmul rate and copy bandwidth of this machine; keeps the better of two readings."""
    from engine.bench.ceilings import measure_ceilings  # imports jax

    m, k, n = (int(x) for x in args.ceiling_shape.split(","))
    now = measure_ceilings(args.ceiling_dtype, m, k, n)
    if before is not None:
        for key in ("matmul_flops_per_s", "copy_bytes_per_s"):
            now[key] = max(now[key], before[key])
    return {**now, "ceiling_dtype": args.ceiling_dtype}


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench serve",
                                description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the `model` field sent with each request")
    p.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="embed: one text per request to an embeddings endpoint, measured in "
                        "texts and prompt tokens a second (engine/bench/serve_embed.py)")
    p.add_argument("--endpoint", default=None,
                   help="a completions-style path: `prompt` in, streamed choices[].text out "
                        "(default /v1/completions); with --task embed, an embeddings path "
                        "(default /v1/embeddings)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len]; 0 = fixed")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second; inf (default) sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma inter-arrival gaps; 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos and min_tokens=output length (vLLM, llama.cpp)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", default=None,
                   help="a fixed text prompt for every request, for servers that reject "
                        "token-id prompts (--input-len is then ignored)")
    p.add_argument("--text-prompts", action="store_true",
                   help="random text of --input-len common words per request (about one token "
                        "each), for servers that take no token-id prompts (llama-cpp-python)")
    p.add_argument("--dataset", default=None,
                   help="conversations from a JSON-lines file ({'messages': [...]} a line), "
                        "sent to /v1/chat/completions with --output-len tokens each, e.g. "
                        "tests/data/grounded_prompts.jsonl; a {'text': ...} line is sent to "
                        "--endpoint as a text prompt (--task embed: each is one text)")
    p.add_argument("--tokenizer-endpoint", action="store_true",
                   help="with --prompt: count its tokens with the server's /tokenize, for "
                        "servers that report no usage.prompt_tokens")
    p.add_argument("--encoding-format", choices=("float", "base64"), default="float",
                   help="--task embed: how the server encodes each vector in its response")
    p.add_argument("--output", help="write the results as JSON")
    p.add_argument("--plot", help="write histograms and CDFs of TTFT/TPOT/ITL/E2EL to a PNG")
    p.add_argument("--label", default=None, help="name of this run in the JSON and plot "
                                                 "(default: the model)")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip measuring this machine's matmul rate and copy bandwidth "
                        "(needs jax; meaningful only when the server runs on this machine)")
    p.add_argument("--ceiling-shape", default="64,576,1536", help="M,K,N of the ceiling matmul")
    p.add_argument("--ceiling-dtype", default="float32")
    args = p.parse_args(argv)
    if args.endpoint is None:
        args.endpoint = "/v1/embeddings" if args.task == "embed" else "/v1/completions"
    if args.task == "embed" and args.plot:
        p.error("--plot draws the generation latencies (TTFT, TPOT, ITL); --task embed has "
                "E2EL alone, in the printed table and --output")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ceilings = None if args.no_ceilings else measure_best_ceilings(args)
    try:
        res = asyncio.run(benchmark(args))
    except (RuntimeError, httpx.HTTPError) as e:  # a failed warmup or /tokenize call
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if ceilings is not None:
        # Ceilings are peaks: a second reading after the run, keep the better of each.
        res |= measure_best_ceilings(args, before=ceilings)
    res |= {"host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "args": vars(args) | {"api_key": "<set>" if args.api_key else None}}
    _, _, print_results = task_client(args.task)
    print_results(res)
    if args.output:
        inf_as_str = lambda d: {k: "inf" if v == float("inf") else v for k, v in d.items()}
        with open(args.output, "w") as f:  # strict JSON, as vLLM writes it: "inf", not Infinity
            json.dump(inf_as_str(res | {"args": inf_as_str(res["args"])}), f, indent=2)
    if args.plot:
        from engine.bench.plot import plot_latencies

        plot_latencies(res, args.plot)
    if errors := [e for e in res["errors"] if e]:
        print(f"{len(errors)} request(s) failed; first errors:", file=sys.stderr)
        for e in errors[:3]:
            print(f"  {e}", file=sys.stderr)
        return 1
    return 0
