"""`python -m server` / `xlaserve`: load the models, warm them up, then serve the OpenAI API.

    python -m server                                   # the default model on 127.0.0.1:8000
    python -m server --model ./Llama-3.2-1B-Instruct --port 8080 --api-key-file key.txt
    python -m server --model small=./a.gguf --model big=./b --max-num-seqs 32

Flags are named as in vLLM (or uvicorn) where vLLM (or uvicorn) has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from engine import sessions, tool_loop
from engine.config import (
    CPU_ACTIVATION_DTYPES,
    CPU_KERNELS,
    CPU_MATMUL_DTYPES,
    KV_CACHE_DTYPES,
    LAYER_LOOPS,
    POOLING_TYPES,
    QUANTIZATION_CHOICES,
    TASKS,
    parse_bytes,
)
from engine.launch import parse_model_arg, start_engines
from server.app import BODY_READ_TIMEOUT, MAX_BODY_BYTES, MAX_HEADERS, build_app
from server.exposure import API_KEY_ENV, allowed_hosts, api_key, serve
from server.generation import STREAM_STALL_TIMEOUT_S
from server.reasoning import REASONING_PARSERS

logger = logging.getLogger("server")

HEADER_READ_TIMEOUT = 10.0  # seconds for a request's headers (from connect or last response)
TIMEOUT_KEEP_ALIVE = 5  # uvicorn's default
LIMIT_CONCURRENCY = 2048  # connections; the default engine queue (1024) fits well inside it


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:  # argparse shows this message instead of "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH",
                   help="GGUF file, HF directory or Orbax checkpoint, or a known model's name "
                        "(smollm2-135m, gemma3-270m: fetched if missing); repeat for several "
                        "models (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the name clients use (one model only; default: "
                                               "the file or directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", metavar="PATH",
                     help="require 'Authorization: Bearer KEY', KEY being this file's text "
                          f"(surrounding whitespace dropped); without it: env {API_KEY_ENV}")
    key.add_argument("--api-key", help="the same with KEY itself (which the process list "
                                       "then shows to every user: prefer the file or env)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weight-only quantization: auto (default) keeps a GGUF file's "
                        "quantized blocks (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) as they are and "
                        "loads the rest in float; none loads every weight in float; int8 (per "
                        "output channel) or int4 (groups of 32 with minimums, 8-bit "
                        "embeddings) quantize the others at load")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pages' dtype: auto (default) is float16 on CPU and the compute "
                        "dtype on GPU/TPU; attention reads it and computes in the compute dtype")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16,
                   help="tokens per KV page")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per model, including the reserved page 0")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="fill this fraction of device memory (RAM on CPU) with weights and KV "
                        "pages; default: pages for every sequence at full length, capped at "
                        "0.9 of an accelerator or, on CPU, at 1/32 of RAM for the KV pages")
    p.add_argument("--kv-cache-memory-bytes", type=_size, default=None, metavar="SIZE",
                   help="the KV pool's size per model (e.g. 768MiB, 2GiB), instead of the "
                        "defaults above; requests beyond it wait for pages or are preempted")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="past this many waiting requests, new ones get 429")
    p.add_argument("--attention-backend", default="auto",
                   choices=("auto", "reference", "cpu", "pallas", "pallas-gpu", "pallas-tpu"),
                   help="auto: pallas on a GPU or TPU, cpu on CPU (reference where our CPU "
                        "kernels cannot be built); reference: pure JAX; cpu: xlaserve's CPU "
                        "kernel; pallas: the Pallas kernel for this platform (interpreted on "
                        "CPU); pallas-gpu/pallas-tpu force one kernel")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each model over this many devices (heads, MLP, vocabulary)")
    p.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="multi-host: process 0's address for jax.distributed (the step channel "
                        "uses PORT + 1)")
    p.add_argument("--num-processes", type=int, default=1,
                   help="multi-host: processes serving together (the mesh spans all their "
                        "devices; --tensor-parallel-size defaults to all of them)")
    p.add_argument("--process-id", type=int, default=0,
                   help="multi-host: this process's rank; 0 serves HTTP, the others follow")
    p.add_argument("--cluster-key-file", metavar="PATH",
                   help="multi-host: a file holding the step channel's shared secret, the same "
                        "on every process (surrounding whitespace dropped); without it: env "
                        "XLASERVE_CLUSTER_KEY. Required when --coordinator-address is not a "
                        "loopback address (on loopback without one, a per-run key is used)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="dispatch each step before reading the previous one's tokens (the "
                        "outputs are the same; default: on)")
    p.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                   help="xlaserve's CPU kernels (matmuls of a few rows, attention): auto "
                        "builds the best variant this CPU runs (XLASERVE_CPU_KERNELS sets what "
                        "auto means), a variant's name forces it, none runs XLA's matmuls and "
                        "the reference attention")
    p.add_argument("--cpu-matmul-dtype", choices=CPU_MATMUL_DTYPES, default="float32",
                   help="the dtype a float32 model's products of more than 8 rows (a "
                        "prompt's chunks, batches) multiply in on a CPU, summed in float32: "
                        "bfloat16 makes prompts several times faster where the CPU has AMX, "
                        "but greedy outputs then depend on what shares a request's steps")
    p.add_argument("--cpu-activation-dtype", choices=CPU_ACTIVATION_DTYPES, default="float32",
                   help="the precision x keeps in the CPU kernel's products with 4-bit "
                        "weights (a few rows: decodes, drafting steps; every row with int8 "
                        "where VNNI multiplies): float32, or int8 per block of 32 as "
                        "llama.cpp's Q8 (a third of the multiplies: faster on CPUs without "
                        "VNNI, and prompts faster with it; other numerics, see docs/serving.md)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's numbers do not depend on what shares its steps, so a "
                        "seeded request samples the same tokens alone or under load (CPU; "
                        "slower: see docs/serving.md)")
    p.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding, vLLM\'s keys: prompt lookup \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 8, '
                        '"prompt_lookup_min": 3}\' or a draft model of the same vocabulary '
                        '\'{"model": PATH_OR_NAME, "num_speculative_tokens": 4}\', with '
                        '"prompt_lookup_max" beside "model": prompt lookup first, the model '
                        'where it finds nothing (off by default; drafts only while a step has '
                        'few sequences; docs/serving.md)')
    p.add_argument("--task", choices=TASKS, default="auto",
                   help="what each model serves: generate (completions, chat, responses) or "
                        "embed (pooled vectors at /v1/embeddings); auto: an encoder-only "
                        "model (BERT) embeds, a decoder generates")
    p.add_argument("--pooling", choices=POOLING_TYPES, default="auto",
                   help="how an embedding model pools its token states: auto (its files' "
                        "1_Pooling/config.json; a decoder: last), mean, cls or last")
    p.add_argument("--embedding-share", type=float, default=0.2, metavar="FRACTION",
                   help="while a generating model has work, an embedding model served beside "
                        "it runs at most this share of the time (1: no limit)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise embeddings (default: as the model's files say; a "
                        "decoder: yes)")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: a request that leaves temperature, top_p, top_k, min_p or "
                        "repetition_penalty unset gets the model's recommended value (an HF "
                        "directory's generation_config.json, or a known model's card); vllm: "
                        "OpenAI's defaults (temperature 1, top_p 1)")
    p.add_argument("--override-generation-config", metavar="JSON", default=None,
                   help='sampling defaults over the model\'s, e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of the model's shapes instead of its files, "
                        "for benchmarks (the directory needs only config.json and a "
                        "tokenizer)")
    p.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                   help="how the model runs its layers: scanned (compile time flat in depth), "
                        "unrolled (on a GPU each layer's float weights are read in place, but "
                        "a large model compiles for minutes), or scanned with float and int8 "
                        "products of 2-128 rows in a Pallas kernel that reads the layer out of "
                        "the stack in place (scan-pallas, one GPU); auto: scan-pallas on one GPU, "
                        "scan elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="chat replies: text inside <think>...</think> goes to the message's "
                        "reasoning_content, the rest to content")
    p.add_argument("--responses-max-stored", type=int, default=sessions.DEFAULT_MAX_RESPONSES,
                   metavar="N", help="stored responses (/v1/responses with store) kept at most; "
                                     "the least recently used go first")
    p.add_argument("--responses-max-bytes", type=_size, default=sessions.DEFAULT_MAX_BYTES,
                   metavar="SIZE", help="bytes the stored responses may hold (default 64MiB)")
    p.add_argument("--responses-ttl", type=_seconds, default=sessions.DEFAULT_TTL_S,
                   metavar="SECONDS", help="a stored response unread this long is dropped")
    p.add_argument("--mcp-config", metavar="FILE", default=None,
                   help="MCP servers whose tools the server runs itself inside a request "
                        "(the mcpServers JSON most MCP clients read: stdio or streamable HTTP)")
    p.add_argument("--max-tool-rounds", type=int, default=tool_loop.DEFAULT_MAX_ROUNDS,
                   metavar="N", help="rounds of server-run tool calls in one request, at most")
    p.add_argument("--tool-timeout", type=_seconds, default=tool_loop.DEFAULT_TIMEOUT_S,
                   metavar="SECONDS", help="a server-run tool call's time limit")
    p.add_argument("--cors-origins", "--allowed-origins", dest="cors_origins", nargs="*",
                   default=[], help="origins allowed by CORS (none by default)")
    p.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="read special-token text written in chat requests (messages, tool "
                        "calls and results, tools, chat_template_kwargs) as those tokens, as "
                        "before; by default only the chat template writes special tokens")
    p.add_argument("--allowed-hosts", metavar="NAMES",
                   help="comma-separated names clients may give as Host (port ignored; "
                        "*.example.com for subdomains; * for any), so that a web page cannot "
                        "reach the server by DNS rebinding; /health answers any Host. "
                        "Default: localhost, 127.0.0.1, ::1 (and --host) when --host is "
                        "loopback, else * (with a warning)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--max-headers", type=int, default=MAX_HEADERS)
    p.add_argument("--timeout-keep-alive", type=int, default=TIMEOUT_KEEP_ALIVE,
                   metavar="SECONDS", help="close a connection idle this long after a response")
    p.add_argument("--header-read-timeout", type=_seconds, default=HEADER_READ_TIMEOUT,
                   metavar="SECONDS", help="close a connection whose request headers are not "
                                           "all in this long after it opened or last answered")
    p.add_argument("--body-read-timeout", type=_seconds, default=BODY_READ_TIMEOUT,
                   metavar="SECONDS", help="a request body not all in this long after its "
                                           "headers: 408 and the connection closed")
    p.add_argument("--stream-stall-timeout", type=_seconds, default=STREAM_STALL_TIMEOUT_S,
                   metavar="SECONDS",
                   help="end a streamed response, aborting its requests, when a write to its "
                        "client has waited this long (the client stopped reading)")
    p.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY, metavar="N",
                   help="at N open connections (busy or idle) or requests in flight, new "
                        "requests get 503; 0: no cap")
    p.add_argument("--log-level", default="info")
    return p


def join_cluster(args) -> int | None:
    """Multi-host: join jax.distributed; followers run until the leader goes and return an
    exit status, process 0 returns None once every follower is connected."""
    from engine import cluster
    from engine.distributed import init_distributed

    if not args.coordinator_address:
        logger.error("--num-processes > 1 needs --coordinator-address HOST:PORT")
        return 2
    try:  # refuse before joining jax.distributed: off loopback the channel needs a secret
        cluster.channel_key(args.coordinator_address, args.cluster_key_file)
    except (ValueError, OSError) as e:
        logger.error("cannot start: %s", e)
        return 2
    num_devices = init_distributed(args.coordinator_address, args.num_processes,
                                   args.process_id)
    if args.process_id != 0:
        return cluster.follow(args.coordinator_address, key_file=args.cluster_key_file)
    if args.tensor_parallel_size == 1:
        args.tensor_parallel_size = num_devices
    if args.tensor_parallel_size != num_devices:
        logger.error("multi-host: the mesh must span all %d devices of the %d processes, not "
                     "--tensor-parallel-size %d", num_devices, args.num_processes,
                     args.tensor_parallel_size)
        return 2
    cluster.leader = cluster.Leader(args.coordinator_address, args.num_processes - 1,
                                    key_file=args.cluster_key_file)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if args.num_processes > 1:
        status = join_cluster(args)
        if status is not None:  # a follower's life is over
            return status
    try:
        key, key_source = api_key(args)
        store = sessions.SessionStore(args.responses_max_stored, args.responses_max_bytes,
                                      args.responses_ttl)
        loop = None
        if args.mcp_config is not None:
            from server.mcp_config import load_mcp_config
            from server.mcp_tools import McpTools

            loop = tool_loop.ToolLoop(McpTools(load_mcp_config(args.mcp_config)),
                                      args.max_tool_rounds, args.tool_timeout)
        specs = [parse_model_arg(m) for m in (args.model or [None])]
        if args.served_model_name:
            if len(specs) != 1:
                raise ValueError("--served-model-name needs exactly one --model; "
                                 "name several models with --model NAME=PATH")
            specs[0] = dataclasses.replace(specs[0], name=args.served_model_name)
        engines = start_engines(
            specs, memory_fraction=args.gpu_memory_utilization,
            kv_memory_bytes=args.kv_cache_memory_bytes, dtype=args.dtype,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.page_size,
            num_blocks=args.num_pages, enable_prefix_caching=args.enable_prefix_caching,
            attention_backend=args.attention_backend,
            tensor_parallel_size=args.tensor_parallel_size,
            max_waiting_requests=args.max_waiting_requests, seed=args.seed,
            async_scheduling=args.async_scheduling, batch_invariant=args.batch_invariant,
            cpu_kernels=args.cpu_kernels, cpu_matmul_dtype=args.cpu_matmul_dtype,
            cpu_activation_dtype=args.cpu_activation_dtype,
            speculative=args.speculative_config,
            layer_loop=args.layer_loop, load_format=args.load_format, task=args.task,
            pooling=args.pooling, normalize=args.normalize,
            embedding_share=args.embedding_share,
            generation_config=args.generation_config,
            generation_overrides=args.override_generation_config)
    except (ValueError, FileNotFoundError, OSError) as e:
        logger.error("cannot start: %s", e)
        return 2
    app = build_app(engines, api_key=key, cors_origins=args.cors_origins,
                    max_body_bytes=args.max_body_bytes, max_headers=args.max_headers,
                    reasoning_parser=args.reasoning_parser, allowed_hosts=allowed_hosts(args),
                    body_read_timeout=args.body_read_timeout,
                    stream_stall_timeout=args.stream_stall_timeout,
                    allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
                    sessions=store, tool_loop=loop,
                    profiler_dir=os.environ.get("XLASERVE_PROFILER_DIR"))
    if args.allow_special_tokens_in_messages:
        logger.warning("--allow-special-tokens-in-messages: special-token text in chat "
                       "requests becomes those tokens (a client can write its own turns)")
    logger.info("Serving %s on http://%s:%d", ", ".join(engines.names()), args.host, args.port)
    try:
        serve(app, args, key_source)
    finally:
        engines.shutdown()
        if args.num_processes > 1:
            from engine import cluster

            cluster.leader.close()  # the followers exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
