"""Model families: the one place that dispatches on a model's architecture.

A checkpoint names its architecture (HF `config.json` `architectures[0]`, or GGUF
`general.architecture`); `FAMILIES` says which module implements it. Everything else asks
here: `ModelConfig` for the family's own config keys, the loaders for its tensor names, the
runner and the loaders for the model class, the tokenizer for a built-in chat template when
the files carry none. Importing this module imports no model code (and no jax): the family's
module is imported when its class is first asked for.

A decoder family's module defines `Model` (an `nnx.Module`, a subclass of
`models.llama.Llama`) with the class methods the loaders use (`param_specs`, `layer_tensors`,
`gguf_layer_names`, `from_gguf`) and `config_fields(hf: dict | None, gguf: dict | None)`, the
family's `ModelConfig` fields from either source. An encoder family (`kind="encoder"`: BERT,
models/bert.py) embeds text and generates none; its module defines `load_encoder` and
`embed`, and `model_kind` tells the two kinds apart before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    module: str                            # defines `Model` and `config_fields`
    hf_architectures: tuple[str, ...]      # HF `architectures[0]` values
    gguf_architectures: dict[str, str]     # GGUF `general.architecture` -> the HF name
    # A built-in chat template (models/chat_template.py BUILTIN_TEMPLATES) for files
    # that carry none (base-model GGUFs).
    chat_template: str | None = None
    # llama.cpp's converter interleaves the rotary pairs of Q and K rows for these
    # HF architectures only (`LlamaModel.permute`); the GGUF loader undoes it.
    gguf_permuted_qk: tuple[str, ...] = ()
    kind: str = "decoder"                  # "decoder" (generates text) | "encoder" (embeds it)


FAMILIES = (
    Family("llama", "models.llama",
           ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
           {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"},
           gguf_permuted_qk=("LlamaForCausalLM",)),
    Family("qwen3", "models.qwen3", ("Qwen3ForCausalLM",), {"qwen3": "Qwen3ForCausalLM"},
           chat_template="chatml"),
    Family("gemma3", "models.gemma3", ("Gemma3ForCausalLM",), {"gemma3": "Gemma3ForCausalLM"},
           chat_template="gemma"),
    Family("bert", "models.bert", ("BertModel", "BertForMaskedLM"), {}, kind="encoder"),
)


class UnsupportedArchitecture(ValueError):
    pass


def _supported(kind: str) -> str:
    names = [a for f in FAMILIES for a in
             (f.hf_architectures if kind == "hf" else f.gguf_architectures)]
    return ", ".join(names)


def family(architecture: str) -> Family:
    """The family of an HF architecture name (what `ModelConfig.architecture` holds)."""
    for f in FAMILIES:
        if architecture in f.hf_architectures:
            return f
    raise UnsupportedArchitecture(f"unsupported architecture {architecture!r}; supported: "
                                  f"{_supported('hf')}")


def gguf_family(gguf_architecture: str) -> tuple[Family, str]:
    """(family, HF architecture name) of a GGUF `general.architecture`."""
    for f in FAMILIES:
        if gguf_architecture in f.gguf_architectures:
            return f, f.gguf_architectures[gguf_architecture]
    raise UnsupportedArchitecture(f"unsupported GGUF architecture {gguf_architecture!r}; "
                                  f"supported: {_supported('gguf')}")


def module(architecture: str):
    """The module of a decoder's HF architecture name (what `ModelConfig` and the loaders
    take); an encoder's is an error that says so."""
    f = family(architecture)
    if f.kind != "decoder":
        raise UnsupportedArchitecture(f"{architecture} is an {f.kind} model: it gives "
                                      f"embeddings, not text")
    return importlib.import_module(f.module)


def model_class(architecture: str):
    """The `nnx.Module` class of an HF architecture name."""
    return module(architecture).Model


def param_specs(cfg, quant=None) -> dict:
    """The parameter specs of `cfg`'s model (models/llama.py `Llama.param_specs`)."""
    return model_class(cfg.architecture).param_specs(cfg, quant)


def declared_architecture(path: str | Path) -> str | None:
    """The HF architecture name a model's files declare (GGUF metadata, `config.json`, or an
    Orbax checkpoint's `xlaserve.json`), read without loading the model; None if unknown."""
    path = Path(path)
    try:
        if path.is_file():
            from models.gguf_file import read_metadata

            return gguf_family(read_metadata(path).get("general.architecture"))[1]
        for name, key in (("config.json", "architectures"), ("xlaserve.json", "config")):
            if (path / name).is_file():
                value = json.loads((path / name).read_text()).get(key)
                return (value or [None])[0] if key == "architectures" else value["architecture"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def model_kind(path: str | Path) -> str:
    """The kind of model at `path`, "decoder" or "encoder", by the architecture its files
    declare (an unknown or unsupported one: "decoder", whose loader says what is wrong)."""
    arch = declared_architecture(path)
    try:
        return family(arch).kind if arch else "decoder"
    except UnsupportedArchitecture:
        return "decoder"


def builtin_chat_template(path: str | Path) -> str | None:
    """The built-in chat template for a model whose files carry none (by its family)."""
    arch = declared_architecture(path)
    try:
        return family(arch).chat_template if arch else None
    except UnsupportedArchitecture:
        return None
