"""python -m engine.bench serve --task embed: texts a second of an OpenAI-compatible
embeddings endpoint.

    python -m engine.bench serve --task embed --base-url http://127.0.0.1:8000 \\
        --model all-MiniLM-L6-v2 --num-prompts 256 --input-len 128 --max-concurrency 64

One text per request (random common words, about --input-len tokens; or --prompt; or a
--dataset's texts, a conversation's messages joined by newlines), sent on serve.py's
schedule (--max-concurrency, --request-rate, warmups) and measured as vLLM's `bench serve
--backend openai-embeddings` measures: request throughput (texts a second), total token
throughput (each response's usage.prompt_tokens, a second) and E2EL (send -> whole response
read) mean/median/p99. A response counts only if it carries one non-empty vector; the
vectors' lengths are reported.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time

import httpx

from engine.bench.serve import Request, Result, latency_stats
from engine.bench.serve_report import print_head, print_latency, print_tail, row


@dataclasses.dataclass
class EmbeddingResult(Result):
    dim: int = 0  # the vector's length


def input_text(prompt: str | list[dict]) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)  # a --dataset conversation


async def send_embedding(client: httpx.AsyncClient, args, req: Request) -> EmbeddingResult:
    text = input_text(req.prompt)
    payload = {"model": args.model, "input": text, "encoding_format": args.encoding_format}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    res = EmbeddingResult(prompt_len=req.prompt_len or len(text.split()))
    for attempt in range(2):
        res.start = time.perf_counter()
        try:
            resp = await client.post(args.base_url.rstrip("/") + args.endpoint, json=payload,
                                     headers=headers)
        except httpx.RemoteProtocolError as e:
            # A kept-alive connection the server had closed: the request never reached it.
            if attempt == 0:
                continue
            res.error = f"{type(e).__name__}: {e}"
            return res
        except Exception as e:  # a benchmark reports failures, it does not stop at them
            res.error = f"{type(e).__name__}: {e}"
            return res
        break
    res.chunk_times = [time.perf_counter()]  # the whole response is read: E2EL ends here
    if resp.status_code != 200:
        res.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
        return res
    try:
        body = resp.json()
        data = body["data"]
        if len(data) != 1 or not data[0]["embedding"]:
            raise ValueError(f"one vector expected, got {json.dumps(data)[:200]}")
        vector = data[0]["embedding"]
        # base64: the little-endian float32 bytes of the vector
        res.dim = len(base64.b64decode(vector)) // 4 if isinstance(vector, str) else len(vector)
    except (ValueError, KeyError, TypeError) as e:
        res.error = f"bad response: {type(e).__name__}: {e}"
        return res
    res.prompt_len = (body.get("usage") or {}).get("prompt_tokens") or res.prompt_len
    res.success = True
    return res


def summarize_embeddings(args, requests: list[Request], results: list[EmbeddingResult],
                         duration: float) -> dict:
    ok = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "label": args.label or args.model, "base_url": args.base_url, "model": args.model,
        "task": "embed", "endpoint": args.endpoint,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "total_input_tokens": in_tokens,
        "request_throughput": len(ok) / duration,
        "total_token_throughput": in_tokens / duration,  # every token is a prompt token
        "embedding_dims": sorted({r.dim for r in ok}),
        **latency_stats("e2el", [r.e2el for r in ok]),
        # Per request, in send order (failed requests: 0), as vLLM's --save-result.
        "input_lens": [r.prompt_len for r in results],
        "e2els": [r.e2el if r.success else 0.0 for r in results],
        "errors": [r.error for r in results],
    }


def print_embedding_table(res: dict) -> None:
    print_head(res, "Embedding Benchmark Result")
    row("Embedding dimensions:", ",".join(map(str, res["embedding_dims"])) or "-")
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    print_latency(res, "e2el", "E2EL", "End-to-end Latency")
    print_tail(res)
