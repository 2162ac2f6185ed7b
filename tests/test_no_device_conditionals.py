"""No host syncs inside the compiled step on a GPU: lowered for platform `cuda` (jax.export, on
this CPU host), the sampler has no conditional whose predicate is device data (on GPU each one
makes the host wait for the predicate). Conditionals on constants (`lax.platform_dependent`
picking the platform's branch) are folded away by XLA and allowed. On CPU the sampler keeps
its conditionals (they skip work no row asks for), which is the positive control."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from ops.sampling import sample
from ops.sampling_metadata import SamplingMetadata

_CONDITIONAL = re.compile(r'^(%[\w#]+)(?::\d+)? = "?stablehlo\.(?:case|if)"?\(?\s*(%[\w#]+)')


def data_dependent_conditionals(mlir: str) -> list[str]:
    """The `stablehlo.case` / `stablehlo.if` ops whose operand is device data: neither a
    constant nor the result of a conditional on a constant (`lax.platform_dependent` lowers
    to a case on the platform index, itself a case on a constant)."""
    constants = set(re.findall(r"(%[\w#]+) = stablehlo\.constant", mlir))
    found = []
    for line in mlir.splitlines():
        m = _CONDITIONAL.search(line.strip())
        if m is None:
            continue
        if m.group(2) in constants:
            constants.add(m.group(1))
        else:
            found.append(line.strip())
    return found


def _sampler_mlir(platform: str) -> str:
    num_seqs, vocab = 4, 1000
    md = SamplingMetadata.dummy(num_seqs, vocab)
    args = (jax.ShapeDtypeStruct((num_seqs, vocab), jnp.float32),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), md))
    return export.export(jax.jit(sample), platforms=[platform])(*args).mlir_module()


def test_the_sampler_has_no_conditional_on_device_data_for_cuda():
    assert data_dependent_conditionals(_sampler_mlir("cuda")) == []


def test_on_cpu_the_sampler_skips_work_with_conditionals():
    # The positive control: the check finds the CPU lowering's conditionals.
    assert len(data_dependent_conditionals(_sampler_mlir("cpu"))) >= 6


def test_the_model_body_with_the_gpu_kernel_has_no_conditional_on_device_data(monkeypatch):
    """The body as the engine compiles it on a GPU (`auto` picks the Pallas GPU kernel there),
    lowered for cuda from this host: no data-dependent case/if around the Triton call. The
    kernel interprets unless the default backend is a GPU, so the test asks for the real
    lowering. (jax.export refuses Triton calls, which have no compatibility guarantee, so
    this one lowers without exporting.)"""
    import functools

    from engine.batch import empty_batch
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from models.presets import preset_config
    from models.weights import random_model
    from ops import attention
    from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention

    monkeypatch.setitem(attention._BACKENDS, "pallas-gpu", functools.partial(
        pallas_gpu_ragged_paged_attention, interpret=False))
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", "off")
    cfg = EngineConfig(model="random:tiny", max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=16, attention_backend="pallas-gpu")
    runner = ModelRunner(cfg, model=random_model(preset_config("tiny"), jnp.float32,
                                                 attention_backend="pallas-gpu"))
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    batch = empty_batch(cfg, (16, 4))
    counts, mask, last = runner.slot_state
    args = jax.tree.map(abstract, (runner.params, runner.kv, last, batch.body))
    text = jax.jit(runner._body).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
    assert data_dependent_conditionals(text) == []
    # and no loop but the layers' own: a loop inside a layer runs as launches from the host
    # (jnp.searchsorted's default method did, in the attention's work items)
    assert text.count("stablehlo.while") == 1
    # the LM head + sampler + per-slot bookkeeping of the same step, and its CPU control
    hidden = np.zeros((cfg.max_num_seqs, runner.model_config.hidden_size), np.float32)
    token_mask = np.zeros((4, -(-runner.model_config.vocab_size // 32)), np.int32)
    args = jax.tree.map(abstract, (runner.params, hidden, counts, mask, last,
                                   batch.sampling_ints, batch.sampling_floats, token_mask))
    for platform, found in (("cuda", 0), ("cpu", 7)):
        text = jax.jit(runner._head).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert len(data_dependent_conditionals(text)) >= found
        if platform == "cuda":
            assert data_dependent_conditionals(text) == []
        # the cutoffs' searches: unrolled passes for cuda, a bisection's loop on CPU
        assert (text.count("stablehlo.while") == 0) == (platform == "cuda")


def _region(mlir: str, at: int) -> str:
    """The text from `at` (just past a region's `{`) to its closing brace."""
    depth = 1
    for i in range(at, len(mlir)):
        depth += {"{": 1, "}": -1}.get(mlir[i], 0)
        if depth == 0:
            return mlir[at:i]
    raise AssertionError("unclosed region")


def _while_body(mlir: str) -> str:
    """The (first) stablehlo.while's body region, with the functions it calls (transitively)."""
    start = mlir.index("stablehlo.while")
    text = _region(mlir, mlir.index("} do {", start) + len("} do {"))
    seen: set[str] = set()
    todo = re.findall(r"func\.call @([\w.$]+)\(", text)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        m = re.search(r"func\.func [^@]*@" + re.escape(name) + r"\(.*?\{\n", mlir)
        callee = _region(mlir, m.end())
        text += callee
        todo += re.findall(r"func\.call @([\w.$]+)\(", callee)
    return text


def test_a_lone_decode_layer_on_gpu_writes_kv_in_place_and_shares_the_work_items(monkeypatch):
    """What a layer of a lone decode launches on a GPU, lowered for cuda from this host: its
    K/V written in place (a scatter's bounds check is two more kernels a layer there), and
    the attention's work items computed once before the layers' loop, not inside it
    (XLA:GPU kept them in the loop: a kernel a layer)."""
    import functools

    from engine.batch import empty_batch
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from models.presets import preset_config
    from models.weights import random_model
    from ops import attention
    from ops.pallas_gpu_attention import pallas_gpu_ragged_paged_attention

    monkeypatch.setitem(attention._BACKENDS, "pallas-gpu", functools.partial(
        pallas_gpu_ragged_paged_attention, interpret=False))
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", "off")
    computed, shared = [], []
    compute = attention._compute_work_items
    monkeypatch.setattr(attention, "_compute_work_items",
                        lambda *a: computed.append(1) or compute(*a))
    lookup = attention.work_items
    monkeypatch.setattr("ops.pallas_gpu_attention.work_items", lambda md, *a: shared.append(
        md.work is not None) or lookup(md, *a))
    cfg = EngineConfig(model="random:tiny", max_model_len=128, max_num_seqs=1,
                       max_num_batched_tokens=16, attention_backend="pallas-gpu")
    runner = ModelRunner(cfg, model=random_model(preset_config("tiny"), jnp.float32,
                                                 attention_backend="pallas-gpu"))
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    counts, mask, last = runner.slot_state
    for tokens in (1, 16):  # one row in place; a chunk's rows scattered
        computed.clear(), shared.clear()
        args = jax.tree.map(abstract, (runner.params, runner.kv, last,
                                       empty_batch(cfg, (tokens, 1)).body))
        text = jax.jit(runner._body).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        body = _while_body(text)
        assert (body.count("stablehlo.scatter") == 0) == (tokens == 1), tokens
        assert body.count("stablehlo.dynamic_update_slice") == (2 if tokens == 1 else 0)
        assert computed == [1] and shared == [True], tokens
