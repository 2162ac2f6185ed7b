"""Shared fixtures. The default model is fetched once into the user cache."""

from __future__ import annotations

import os

# Tests run on the CPU in float32 unless a test says otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(scope="session")
def default_gguf():
    from models.default_model import fetch_default_model

    return fetch_default_model(quiet=True)
