"""Serving start-up: --model arguments, served names, and KV pages from a memory fraction."""

from __future__ import annotations

import pytest

from engine import device, launch
from engine.config import EngineConfig
from models.known_models import SERVED_NAME


def test_model_arguments(default_gguf, tmp_path):
    assert launch.parse_model_arg(None) == launch.ModelSpec(SERVED_NAME, str(default_gguf))
    assert launch.parse_model_arg(str(default_gguf)).name == SERVED_NAME
    assert launch.parse_model_arg(f"smol={default_gguf}") == launch.ModelSpec("smol",
                                                                             str(default_gguf))
    # A served name for a known model, by its name (the file is in the cache already).
    assert launch.parse_model_arg("smol=smollm2-135m") == launch.ModelSpec("smol",
                                                                          str(default_gguf))
    other = tmp_path / "my-model"
    other.mkdir()
    assert launch.parse_model_arg(str(other)).name == "my-model"
    odd = tmp_path / "a=b"  # an existing path with '=' in it is a path, not name=path
    odd.mkdir()
    assert launch.parse_model_arg(str(odd)) == launch.ModelSpec("a=b", str(odd))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        launch.parse_model_arg("x=/no/such/file.gguf")


def test_kv_pages_from_memory(default_gguf, monkeypatch):
    import dataclasses

    gib = 2**30
    monkeypatch.setattr(device, "device_memory_bytes", lambda: 4 * gib)
    cfg = EngineConfig(model=str(default_gguf), dtype="float32", kv_cache_dtype="float32",
                       max_model_len=256, max_num_seqs=4)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 -> a 16-token float32 page is 2*30*16*3*64*4 B
    page = 2 * 30 * 16 * 3 * 64 * 4
    weights = 4 * 134_515_008
    assert device.kv_pages(cfg, memory_fraction=0.5) == int((0.5 * 4 * gib - weights) // page)
    # two models share the fraction
    assert device.kv_pages(cfg, 0.5, num_models=2) == int((0.25 * 4 * gib - weights) // page)
    # default: pages for every sequence at full length ...
    assert device.kv_pages(cfg) == cfg.total_blocks == 1 + 4 * 16
    # ... within 1/32 of RAM on CPU (64 x 2048 tokens would take 5.6 GiB)
    many = dataclasses.replace(cfg, max_num_seqs=64, max_model_len=2048)
    assert device.kv_pages(many) == int(4 * gib / 32 // page) == 182
    # float16 pages (the default on CPU): twice as many in the same budget
    assert device.kv_pages(dataclasses.replace(many, kv_cache_dtype="auto")) == 364
    # an explicit budget, whatever the need
    assert device.kv_pages(many, kv_memory_bytes=200 * page) == 200
    assert device.kv_pages(EngineConfig(model=str(default_gguf), num_blocks=7)) == 7
    # a budget too small for one max_model_len sequence (128 pages) is a startup error
    with pytest.raises(ValueError, match=r"holds 99 KV pages of 16 tokens, fewer than one "
                                         r"sequence of max_model_len 2048 needs \(128\)"):
        device.kv_pages(many, kv_memory_bytes=100 * page)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        device.kv_pages(cfg, memory_fraction=0.1)
    # the weights as held (here a quarter of the float estimate) and the step's own memory
    assert device.kv_pages(cfg, 0.5, weight_bytes=weights / 4, step_bytes=10 * page) == int(
        (0.5 * 4 * gib - weights / 4) // page) - 10
    # what the server starts from: pages now for a byte budget or the CPU default, a share
    # of memory left to the runner, split between the models served
    assert device.size_kv(cfg).num_blocks == cfg.total_blocks
    assert device.size_kv(many, kv_memory_bytes=200 * page).num_blocks == 200
    shared = device.size_kv(cfg, 0.5, num_models=2)
    assert (shared.num_blocks, shared.gpu_memory_utilization) == (None, 0.25)
    # a draft model (here the model drafting for itself): its pool has as many pages, and
    # its weights come out of a memory share too
    drafting = dataclasses.replace(cfg, speculative={"model": str(default_gguf)})
    assert device.kv_pages(drafting, kv_memory_bytes=200 * page) == 100
    assert device.kv_pages(drafting, memory_fraction=0.5) == int(
        (0.5 * 4 * gib - 2 * weights) // (2 * page))


def test_a_memory_share_is_sized_after_the_weights_and_the_largest_step(tmp_path, monkeypatch):
    import dataclasses

    import jax
    from tiny_models import save_tiny_hf

    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner

    tiny = save_tiny_hf(tmp_path / "tiny")
    monkeypatch.setenv("XLASERVE_COMPILE_CACHE", "off")
    mib = 2**20
    monkeypatch.setattr(device, "device_memory_bytes", lambda: 64 * mib)
    cfg = device.size_kv(EngineConfig(model=str(tiny), dtype="float32", kv_cache_dtype="float32",
                                      max_model_len=128, max_num_seqs=4,
                                      max_num_batched_tokens=64), memory_fraction=0.5)
    runner = ModelRunner(cfg)
    step = runner.step_bytes()
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    page = 2 * 2 * 16 * 8 * 16 * 4  # 2 layers, 16-token pages, 8 KV heads of 16, float32
    assert step > 10 * page  # so that leaving it out would show
    assert runner.config.num_blocks == int((0.5 * 64 * mib - weights - step) // page)
    assert runner.kv.num_pages == runner.config.num_blocks
    # the probe is the largest bucket: a larger one needs more, and leaves fewer pages
    bigger = ModelRunner(dataclasses.replace(cfg, max_num_batched_tokens=512))
    assert bigger.step_bytes() > step
    assert bigger.config.num_blocks < runner.config.num_blocks
    # the engine books the pages the runner made
    engine = LLMEngine(cfg, runner=runner)
    assert engine.block_manager.num_blocks == runner.config.num_blocks
    # a model given as weights (no file to read a config from) is sized the same way
    import jax.numpy as jnp

    from models.presets import preset_config
    from models.weights import random_model

    given = ModelRunner(dataclasses.replace(cfg, model="random:tiny"),
                        model=random_model(preset_config("tiny"), jnp.float32))
    assert given.config.num_blocks is not None and given.kv.num_pages == given.config.num_blocks


def test_sizes_in_bytes():
    from engine.config import parse_bytes

    assert parse_bytes("768MiB") == 768 * 2**20
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "12XB", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
