"""A fake model runner (next token = previous token + step) and engines built on it, so
engine and server tests can compute every output by hand without compiling anything."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import httpx
import numpy as np
import uvicorn

from engine.async_engine import AsyncEngine, Engines
from engine.config import EngineConfig
from engine.draft_costs import StepCosts
from engine.embedding_engine import embed_buckets
from engine.llm_engine import LLMEngine
from engine.model_runner import StepResult


class EqualCosts(StepCosts):
    """Speculative decoding's cost model with every token bucket costing the same and nothing
    learnt from timings, so a test's drafting never depends on the machine's speed."""

    def record(self, bucket, seconds):
        pass

    def record_round(self, seconds):  # a draft model's rounds: free
        pass

    def of(self, bucket):
        return 1.0


class Done:
    """A step that already ran (what `submit` returns for a runner without a device)."""

    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


class FakeRunner:
    def __init__(self, step: int = 1, modulus: int | None = None):
        """Next token = (previous + step), modulo `modulus` if given (outputs that repeat,
        for speculative decoding's prompt lookup)."""
        self.step, self.warm, self.compilations_after_warmup = step, False, 0
        self.modulus = modulus
        self.fail_next = False
        self.gate = threading.Event()
        self.gate.set()
        self.calls, self.pause_after = 0, None  # pause_after: block from that call on
        self.paused = threading.Event()  # set once a call has blocked on pause_after
        self.unpaused = False  # unpause() came first: the pause no longer happens
        self.last = np.zeros(1024, np.int32)  # each slot's last sampled token (a device's)
        self.weight_bytes = 0  # no device memory

    def kv_bytes(self) -> int:
        return 0

    def unpause(self):
        """Unblock a paused step, or cancel the pause if no step has reached it yet (a
        plain gate.set() before the pause would be undone by the pausing step's clear())."""
        self.unpaused = True
        self.gate.set()

    def warmup(self):
        self.warm = True
        return 0.0

    def release(self):
        self.warm = False

    def submit(self, batch):
        return Done(self.run(batch))

    def run(self, batch):
        self.calls += 1
        if self.calls == self.pause_after and not self.unpaused:
            self.gate.clear()
            self.paused.set()
        self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected fault")
        n = batch.num_rows
        tokens = batch.host_tokens(self.last)  # pending rows: their slot's last token
        ids = (tokens[batch.logits_indices[:n]] + self.step).astype(np.int32)
        if self.modulus:
            ids %= self.modulus
        self.last[batch.sampling["slots"][:n]] = ids
        return StepResult(ids, np.zeros(n, np.float32), np.zeros((n, 20), np.int32),
                          np.zeros((n, 20), np.float32))


def make_engine(tokenizer, name="fake", step=1, max_model_len=128, **over):
    cfg = EngineConfig(model="fake", name=name, max_model_len=max_model_len, max_num_seqs=8,
                       max_num_batched_tokens=32, **over)
    runners = []

    def factory(c):
        runners.append(FakeRunner(step))
        return LLMEngine(c, runner=runners[-1], tokenizer=tokenizer)

    return AsyncEngine(cfg, factory), runners


@contextlib.contextmanager
def serving(engines: Engines, **app_options):
    """A live server (uvicorn on 127.0.0.1, in a thread) for `engines`: yields its URL."""
    from server.app import build_app

    with live(build_app(engines, **app_options)) as url:
        yield url


@contextlib.contextmanager
def live(app):
    """`app` on 127.0.0.1 under uvicorn in a thread, its lifespan run: yields the base URL."""
    from servers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(cond, timeout=30.0, interval=0.01) -> bool:
    """Poll `cond` until it holds; the bound only turns a bug into a failure (a loaded CI
    machine can take seconds to reboot an engine)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return False



def assert_holds_nothing(url: str, engine) -> None:
    """After a barrage of requests against a live fake server: it is up, its engine never
    restarted, no request is left running and every KV block is free."""
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert engine.num_restarts == 0  # (an engine thread that died mid-stream answers 200)
    assert wait_until(lambda: not engine.engine.has_unfinished(), timeout=60)
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


class FakeEmbeddingRunner:
    """An embedding runner whose vector of a row is [sum of its ids, its length, its first
    id]; every run recorded."""

    max_model_len = 64
    vocab_size = 1000
    hidden_size = 3
    truncations = ()
    pooling = types.SimpleNamespace(normalize=False)
    weight_bytes = 0
    compilations_after_warmup = 0

    def __init__(self, config, fail_on=None, gate=None):
        self.buckets = embed_buckets(config.max_num_seqs, config.max_num_batched_tokens,
                                     self.max_model_len)
        self.runs = []
        self.warm = False
        self.fail_on = fail_on  # a first id that makes run() raise
        self.gate = gate  # a threading.Event each run waits for

    def warmup(self):
        self.warm = True

    def encode(self, text):
        return [ord(c) for c in text]

    def run(self, tokens, lengths):
        """tokens [T]: the rows packed one after another (padding zeros after them)."""
        if self.gate is not None:
            self.gate.wait(10)
        assert (len(tokens), len(lengths)) in self.buckets
        self.runs.append((tokens.copy(), lengths.copy()))
        assert (tokens[lengths.sum():] == 0).all()
        rows = np.split(tokens[:lengths.sum()], np.cumsum(lengths)[:-1])
        if self.fail_on is not None and any(len(r) and r[0] == self.fail_on for r in rows):
            raise RuntimeError("device fell over")
        return np.array([[r.sum(), len(r), r[0] if len(r) else 0] for r in rows], np.float32)

    def release(self):
        pass


def make_embedding_engine(name="embed", **over):
    """An EmbeddingEngine over a FakeEmbeddingRunner: (engine, the runners it built)."""
    from engine.embedding_engine import EmbeddingEngine

    runners = []
    cfg = EngineConfig(model=name, name=name, task="embed", max_num_seqs=8,
                       max_num_batched_tokens=64, **over)
    return EmbeddingEngine(cfg, factory=lambda c: runners.append(FakeEmbeddingRunner(c))
                           or runners[-1]), runners
