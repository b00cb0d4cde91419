"""Which weight matrices an edit may touch: all tensor-name knowledge per architecture lives here.

Names are the on-disk safetensors names without the ``.weight`` suffix, so a name from a checkpoint
index, a patch file and a live module (``Runtime.named_linears()``) agree.

Only per-layer linear maps of the decoder are ever targeted. Embeddings, ``lm_head`` (the Clef joint
head reads its rows), norms, the vision tower and ``mtp.*`` are never returned by this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from clef_model.errors import BlazeError

#: Matrices that write the residual stream (their output is added to it).
WRITERS: list[str] = ["self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj"]
#: Matrices that read the (normalised) residual stream.
READERS: list[str] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "mlp.gate_proj",
    "mlp.up_proj",
]
KIND_GROUPS: dict[str, list[str]] = {"writers": WRITERS, "readers": READERS, "all": WRITERS + READERS}

#: Prefix of the decoder layers per architecture (Clef / Qwen3.5 multimodal nest the text model).
LAYER_PREFIX: dict[str, str] = {
    "qwen3_5": "model.language_model.layers",
    "qwen3_5_text": "model.layers",
    "llama": "model.layers",
    "qwen2": "model.layers",
    "qwen3": "model.layers",
    "gemma3": "model.layers",
}
#: Architectures whose layers mix Gated DeltaNet linear attention and full attention.
HYBRID_ATTENTION = {"qwen3_5", "qwen3_5_text"}
_FULL_ATTENTION_INTERVAL = 4  # Qwen3.5: layer i is full attention when i % 4 == 3


def _prefix(architecture: str) -> str:
    try:
        return LAYER_PREFIX[architecture]
    except KeyError:
        known = ", ".join(sorted(LAYER_PREFIX))
        raise BlazeError(f"unknown architecture {architecture!r}: blaze can edit {known}") from None


def layer_count(release_or_config: Any) -> int:
    """Number of decoder layers of a release, a config dict, a config object or a folder with config.json."""
    obj = release_or_config
    if hasattr(obj, "path") and hasattr(obj, "architecture"):  # a Release
        obj = Path(obj.path)
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if path.is_dir():
            path = path / "config.json"
        obj = json.loads(path.read_text())
    if not isinstance(obj, dict):
        obj = obj.to_dict() if hasattr(obj, "to_dict") else vars(obj)
    for key in ("text_config", "language_config"):
        if isinstance(obj.get(key), dict) and "num_hidden_layers" in obj[key]:
            return int(obj[key]["num_hidden_layers"])
    if "num_hidden_layers" in obj:
        return int(obj["num_hidden_layers"])
    raise BlazeError("config has no num_hidden_layers: is this a decoder checkpoint?")


def layer_types(architecture: str, num_layers: int, config: dict | None = None) -> list[str]:
    """Attention type of each layer: "full_attention" or "linear_attention".

    Qwen3.5 configs list them in ``layer_types``; without a config the documented rule (every fourth
    layer is full attention) is used. Other architectures are all full attention.
    """
    if config:
        text = config.get("text_config", config)
        if isinstance(text.get("layer_types"), list) and len(text["layer_types"]) == num_layers:
            return list(text["layer_types"])
    if architecture in HYBRID_ATTENTION:
        return [
            "full_attention" if i % _FULL_ATTENTION_INTERVAL == _FULL_ATTENTION_INTERVAL - 1 else "linear_attention"
            for i in range(num_layers)
        ]
    return ["full_attention"] * num_layers


def parse_kinds(kinds: str | Iterable[str]) -> list[str]:
    """Expand ``writers`` / ``readers`` / ``all`` / explicit kinds (``mlp.down_proj`` or ``down_proj``)."""
    items = [k.strip() for k in (kinds.split(",") if isinstance(kinds, str) else kinds) if k.strip()]
    if not items:
        raise BlazeError("no target kinds given: use writers, readers, all, or names such as mlp.down_proj")
    out: list[str] = []
    every = WRITERS + READERS
    for item in items:
        if item in KIND_GROUPS:
            expanded = KIND_GROUPS[item]
        elif item in every:
            expanded = [item]
        else:
            expanded = [k for k in every if k.split(".")[-1] == item]
            if not expanded:
                raise BlazeError(
                    f"unknown target kind {item!r}: use writers, readers, all, or one of {', '.join(every)}"
                )
        out.extend(k for k in expanded if k not in out)
    return out


def parse_layers(spec: str | int | Iterable[int], num_layers: int) -> list[int] | Literal["auto"]:
    """Parse a layer spec into sorted layer indices.

    Accepted: ``"auto"``; a range ``"8-24"`` (inclusive); fractions of the depth ``"0.4-0.8"``
    (rounded to the nearest layer, inclusive); single numbers; comma lists of any of these
    (``"3,5,7"``, ``"2-4,10"``). Anything outside ``0..num_layers-1`` is an error.
    """
    if isinstance(spec, int):
        spec = str(spec)
    if not isinstance(spec, str):
        spec = ",".join(str(int(i)) for i in spec)
    text = spec.strip().lower()
    if text == "auto":
        return "auto"
    if not text:
        raise BlazeError("empty layer spec: use e.g. 8-24, 0.4-0.8, 3,5,7 or auto")
    last = num_layers - 1
    chosen: set[int] = set()

    def index(token: str) -> int:
        token = token.strip()
        if re.fullmatch(r"\d+", token):
            value = int(token)
        elif re.fullmatch(r"(0?\.\d+|1(\.0*)?|0)", token):
            value = round(float(token) * last)
        else:
            raise BlazeError(f"bad layer spec {spec!r}: {token!r} is not a layer number or a fraction in [0, 1]")
        if not 0 <= value <= last:
            raise BlazeError(f"layer {value} out of range: this model has layers 0-{last} ({num_layers} layers)")
        return value

    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            lo, hi = index(lo_text), index(hi_text)
            if lo > hi:
                raise BlazeError(f"bad layer range {part!r}: start is after end")
            chosen.update(range(lo, hi + 1))
        else:
            chosen.add(index(part))
    return sorted(chosen)


def target_names(
    architecture: str,
    num_layers: int,
    layers: Iterable[int],
    kinds: str | Iterable[str],
    *,
    types: list[str] | None = None,
) -> list[str]:
    """Tensor names (without ``.weight``) of the chosen kinds in the chosen layers.

    On hybrid Qwen3.5 layers only the attention variant the layer has is returned (``self_attn.*`` on
    full-attention layers, ``linear_attn.*`` on the others). ``types`` overrides the per-layer
    attention types (see :func:`layer_types`).
    """
    prefix = _prefix(architecture)
    kind_list = parse_kinds(kinds)
    types = types or layer_types(architecture, num_layers)
    names: list[str] = []
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise BlazeError(f"layer {layer} out of range: this model has layers 0-{num_layers - 1}")
        attention = "self_attn" if types[layer] == "full_attention" else "linear_attn"
        for kind in kind_list:
            block = kind.split(".")[0]
            if block in ("self_attn", "linear_attn") and block != attention:
                continue
            names.append(f"{prefix}.{layer}.{kind}")
    return names


def resolve_targets(
    available: Iterable[str],
    architecture: str,
    num_layers: int,
    layers: Iterable[int],
    kinds: str | Iterable[str],
) -> list[str]:
    """Like :func:`target_names` but keeps only names the model really has (any ``.weight`` suffix dropped).

    Raises when nothing matches, so a wrong kind for an architecture is reported rather than ignored.
    """
    have = {n[: -len(".weight")] if n.endswith(".weight") else n for n in available}
    wanted = target_names(architecture, num_layers, layers, kinds)
    found = [n for n in wanted if n in have]
    if not found:
        raise BlazeError(
            f"no weight matrices of kinds {parse_kinds(kinds)} in layers {list(layers)} of this "
            f"{architecture} model: pick other --kinds or --layers"
        )
    return found


_NAME = re.compile(r"^(?P<prefix>.*layers)\.(?P<layer>\d+)\.(?P<kind>.+)$")


def split_name(name: str) -> tuple[int, str]:
    """``model.layers.7.mlp.down_proj`` -> ``(7, "mlp.down_proj")``."""
    match = _NAME.match(name[: -len(".weight")] if name.endswith(".weight") else name)
    if not match:
        raise BlazeError(f"{name!r} is not a per-layer decoder matrix")
    return int(match["layer"]), match["kind"]
