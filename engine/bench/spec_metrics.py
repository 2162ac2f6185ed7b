"""The server's speculative decoding counters, read from its /metrics before and after a run
of `python -m engine.bench serve`: what the run drafted and kept (no jax)."""

from __future__ import annotations

import httpx

SPEC_COUNTERS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}


async def spec_counters(client: httpx.AsyncClient, args) -> dict[str, float]:
    """The server's speculative decoding counters from /metrics (xlaserve:spec_decode_* or
    vllm:spec_decode_*, summed over models); {} when it has none or no /metrics."""
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = await client.get(base + "/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        for prefix in ("xlaserve:spec_decode_", "vllm:spec_decode_"):
            key = name.removeprefix(prefix).removesuffix("_total")
            if name.startswith(prefix) and key in SPEC_COUNTERS:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def spec_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Acceptance rate and mean accepted length (tokens a drafting step gave: the kept drafts
    and the token sampled after them) over the run."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    if not after or not delta["num_drafts"]:
        return {}
    return {"spec_num_drafts": int(delta["num_drafts"]),
            "spec_num_draft_tokens": int(delta["num_draft_tokens"]),
            "spec_acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"],
            "spec_mean_accepted_length": 1 + delta["num_accepted_tokens"] / delta["num_drafts"]}
