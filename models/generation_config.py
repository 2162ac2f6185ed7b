"""A model's recommended sampling values: what a request that leaves them unset gets, as vLLM
does with a model's `generation_config.json`.

Where they come from, first found: an HF directory's `generation_config.json` (its
temperature, top_p, top_k, min_p and repetition_penalty, whichever it sets); for a known
model's file (models/known_models.py), the values its card recommends. Other models have none,
and a request's unset fields keep OpenAI's defaults (temperature 1, top_p 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from models.known_models import KNOWN_MODELS

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: str | Path) -> tuple[dict[str, float], str | None]:
    """(field -> value, where they come from) for the model at `path`; ({}, None) if none."""
    path = Path(path)
    if path.is_dir():
        file = path / "generation_config.json"
        if not file.is_file():
            return {}, None
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{file}: cannot read it ({e})") from None
        values = {k: config[k] for k in FIELDS if config.get(k) is not None}
        return values, (str(file) if values else None)
    for known in KNOWN_MODELS.values():
        if path.name == known.file_name and known.sampling:
            return dict(known.sampling), f"{known.name}'s model card"
    return {}, None


def parse_overrides(text: str | None) -> dict[str, float]:
    """--override-generation-config: a JSON object of FIELDS."""
    if not text:
        return {}
    try:
        values = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--override-generation-config is not JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(FIELDS)}")
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise ValueError(f"--override-generation-config: {', '.join(bad)} must be numbers")
    return values
