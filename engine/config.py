"""EngineConfig: everything that decides an engine's shapes and limits, validated once."""

from __future__ import annotations

import dataclasses
import functools

from engine.speculative import SpeculativeConfig

# The --quantization choices: ops.quantization.CHOICES (this module imports no jax; a test
# holds the two equal).
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "w8a8")
# The --kv-cache-dtype choices: ops.kv_cache.KV_CACHE_DTYPES (held equal by a test too).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
# The --layer-loop choices: models.run_options.LAYER_LOOPS (held equal by a test; set_run_options
# says what each does); auto is scan-pallas on one GPU, scan elsewhere.
LAYER_LOOPS = ("auto", "scan", "unroll", "scan-pallas")
# The --cpu-kernels choices: ops.native.CHOICES (held equal by a test).
CPU_KERNELS = ("auto", "avx512", "avx2", "neon", "portable", "none")
CPU_MATMUL_DTYPES = ("float32", "bfloat16")  # ops.xla_linear.WIDE_DTYPES
CPU_ACTIVATION_DTYPES = ("float32", "int8")  # ops.cpu_linear.X_BITS's keys
# The --task and --pooling choices (EngineConfig.task, .pooling; models.pooling's modes).
TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("auto", "mean", "cls", "last")
# Decodes of up to this many sequences run body and head as one executable: a lone decode
# saves the chained head's launch with it, a few sequences saved nothing measurable, and each
# fused executable holds memory of its own (docs/performance-log.md, "A lone decode in one
# executable"). With speculative decoding a lone sequence's drafting step is fused too
# (EngineConfig.step_buckets).
FUSED_MAX_SEQS = 1
# A request's outputs wait on its stream until the consumer takes them (engine/request_stream.py).
# Past STREAM_MAX_ITEMS waiting outputs a new delta merges into the last one, so a consumer
# that lags costs memory for the new tokens only; past STREAM_BACKLOG_LIMIT waiting token ids
# and top logprobs (~130 bytes each as Python objects with 20 top logprobs a token: ~32 MiB)
# the request is aborted, since a consumer that far behind has stopped reading.
STREAM_MAX_ITEMS = 16
STREAM_BACKLOG_LIMIT = 1 << 18


def parse_bytes(text: str | int) -> int:
    """'768MiB', '2GiB', '1.5G', '4096' -> bytes (KiB/MiB/GiB binary, K/M/G and KB/MB/GB
    decimal): the value of --kv-cache-memory-bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
             "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
             "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 768MiB, 2GiB, 1.5G)") from None
    if value <= 0:
        raise ValueError(f"a size in bytes must be positive, got {text!r}")
    return int(value)


@functools.cache  # the buckets are asked for at every step
def _pow2_upto(lo: int, hi: int) -> tuple[int, ...]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    out.append(hi)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str                          # path of a GGUF file, HF directory or Orbax checkpoint
    name: str | None = None             # served model name (default: derived from the path)
    dtype: str = "auto"                 # float32 | bfloat16 | auto
    quantization: str = "auto"          # auto | none | int8 | int4: weight-only; auto keeps a
                                        # GGUF's blocks (models/gguf_blocks.py)
    kv_cache_dtype: str = "auto"        # the KV pages' dtype; auto: float16 on CPU, the
                                        # compute dtype elsewhere (ops.kv_cache)
    max_model_len: int = 2048           # prompt + output tokens per sequence
    max_num_seqs: int = 64              # sequences per step
    max_num_batched_tokens: int = 512   # tokens per step (prefill chunks + decodes)
    block_size: int = 16                # tokens per KV page
    num_blocks: int | None = None       # KV pages incl. the reserved page 0 (None: enough for
                                        # max_num_seqs full-length sequences, unless:)
    # The KV pool fills this fraction of device memory, after the weights and the largest
    # step's temporary memory: sized by the runner once those are known (engine.device).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"     # the platform's best (ops.attention.resolve_backend)
    tensor_parallel_size: int = 1       # devices the model is split over (heads, MLP, vocab)
    max_waiting_requests: int = 1024
    seed: int = 0                       # seeds of requests that bring none are drawn from this
    # Dispatch step n+1 before reading step n's tokens (the device never waits on the host's
    # bookkeeping; outputs are the same). On everywhere: on the 2-core CPU too, since the
    # CPU kernels (docs/performance.md).
    async_scheduling: bool = True
    # A row's numbers the same bits whatever shares its step, so a seeded request samples the
    # same tokens alone or under load (docs/architecture.md, "Batch-invariant rows"). Off by
    # default: it runs our integer kernel where XLA's float GEMM is faster, which costs
    # throughput at many streams and time to first token (docs/serving.md has the figures).
    batch_invariant: bool = False
    # How the model loops over its layers (LAYER_LOOPS, models.run_options.set_run_options): scanned
    # (compile time flat in depth), unrolled (XLA:GPU reads each layer's float weights in
    # place only at a constant index, but compiles for minutes on an 8B model), or scanned
    # with float and per-channel int8 products of 2-128 rows in ops/pallas_gpu_matmul, which
    # reads the layer out of the stack in place (one GPU; auto's choice there, measured in
    # docs/performance-log.md, "Weights read in place on an H100").
    layer_loop: str = "auto"
    # xlaserve's CPU kernels (ops/native): "auto" builds the best variant this CPU runs
    # (XLASERVE_CPU_KERNELS sets what auto means); a variant's name forces it (a CPU without
    # its features is an error); "none" leaves them off in this process (XLA's matmuls and
    # the reference attention). Applied before the engine loads its model.
    cpu_kernels: str = "auto"
    # The dtype XLA's products of more than 8 rows on a CPU (a prompt's chunks, batches of
    # decodes) multiply in, for a float32 model: "bfloat16" (ops.xla_linear.wide_dtype:
    # several times faster prompts where the CPU has AMX, but a greedy request's tokens then
    # depend on what shares its steps) or float32.
    cpu_matmul_dtype: str = "float32"
    # The precision x keeps in our CPU kernel's products with 4-bit weights (a few rows: lone
    # decodes, drafting steps): "float32" (24-bit integers per block of 32, float32's own
    # precision) or "int8" (8 bits per block of 32, as llama.cpp's Q8 activations: a third of
    # the dot products, for CPUs whose lone decode is bound by them, such as AVX2 without
    # VNNI; ops.cpu_linear.X_BITS).
    cpu_activation_dtype: str = "float32"
    # "dummy": random weights of the model's shapes instead of its files (benchmarks).
    load_format: str = "auto"
    # Speculative decoding by prompt lookup (engine/speculative.py); None: off.
    speculative: SpeculativeConfig | None = None
    # What the model serves: "generate", or "embed" (pooled vectors for /v1/embeddings,
    # engine/embedding_engine.py); "auto" is what the model's kind says (an encoder embeds,
    # a decoder generates).
    task: str = "auto"
    # An embedding model's pooling: "auto" (its files say; a decoder: the last token's
    # state), "mean", "cls" or "last"; and whether its vectors are L2-normalised (None: its
    # files say; a decoder: yes).
    pooling: str = "auto"
    normalize: bool | None = None
    # While a generating model of the same server has work, an embedding model's steps take at
    # most this share of the time (it waits after each step): on a CPU, whose cores the two
    # would otherwise split, a chat's time per token stays near what it is alone. 1: no
    # waiting (engine/embedding_engine.py).
    embedding_share: float = 0.2

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_waiting_requests", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs})")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, "
                             f"got {self.cpu_kernels!r}")
        if self.cpu_matmul_dtype not in CPU_MATMUL_DTYPES:
            raise ValueError(f"cpu_matmul_dtype must be one of {', '.join(CPU_MATMUL_DTYPES)}, "
                             f"got {self.cpu_matmul_dtype!r}")
        if self.cpu_activation_dtype not in CPU_ACTIVATION_DTYPES:
            raise ValueError(f"cpu_activation_dtype must be one of "
                             f"{', '.join(CPU_ACTIVATION_DTYPES)}, "
                             f"got {self.cpu_activation_dtype!r}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, "
                             f"got {self.layer_loop!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.speculative is not None and not isinstance(self.speculative,
                                                           SpeculativeConfig):
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not 0 < self.embedding_share <= 1:
            raise ValueError(f"embedding_share must be in (0, 1], got {self.embedding_share}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling!r}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (page 0 is reserved), "
                             f"got {self.num_blocks}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def total_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return 1 + self.max_num_seqs * self.max_blocks_per_seq

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded token counts of a step: powers of two from 1 (a lone decode is not padded
        to 16 rows) to max_num_batched_tokens. The model body is compiled once per entry."""
        return _pow2_upto(1, self.max_num_batched_tokens)

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        """Padded sequence counts of a step: powers of two up to max_num_seqs. The LM head and
        sampler are compiled once per entry."""
        return _pow2_upto(1, self.max_num_seqs)

    def body_seqs(self, num_tokens: int) -> int:
        """Sequences the attention metadata of a `num_tokens` body bucket holds: every
        sequence brings at least one token, and no step has more than max_num_seqs."""
        return min(num_tokens, self.max_num_seqs)

    @property
    def step_buckets(self) -> tuple[int, ...]:
        """Decodes of up to FUSED_MAX_SEQS sequences, one token each (buckets (N, N)), run as
        one executable, body and head together (a lone decode, at the default). With
        speculative decoding, also a lone sequence's drafting step: its last token and k
        drafts are k + 1 tokens and as many head rows (N, N), cut to a bucket by the
        scheduler (speculative.fit_drafts); such a step cannot overlap the host's work, so
        the head's launch is all exposed."""
        most = FUSED_MAX_SEQS
        if self.speculative is not None:
            most = max(most, self.speculative.num_speculative_tokens + 1)
        return tuple(n for n in self.seq_buckets if n <= most and n in self.token_buckets)

    def buckets(self) -> list[tuple[str, int]]:
        """Every executable warmup compiles: ("tokens", T) bodies, ("seqs", S) heads, ("step",
        N) body and head in one for the small decodes, and the one that resets a slot's
        penalty counts when a request with penalties takes it."""
        return ([("tokens", t) for t in self.token_buckets]
                + [("seqs", s) for s in self.seq_buckets]
                + [("step", n) for n in self.step_buckets] + [("penalties", 1)])

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (tokens T, sequences S) bucket of a step; warmup and runtime both come here."""
        t = next((b for b in self.token_buckets if b >= num_tokens), None)
        s = next((b for b in self.seq_buckets if b >= num_seqs), None)
        if t is None or s is None or num_seqs > num_tokens:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} sequences is outside the "
                             f"bucket table ({self.max_num_batched_tokens} / {self.max_num_seqs})")
        return t, s  # s <= body_seqs(t): every sequence brings at least one token
