"""Export a patch as a PEFT LoRA adapter equal to the edit: lora_B = U, lora_A = Vᵀ, scaling 1.

A LoRA layer adds (lora_alpha / r) · B A to a linear layer's weight; with B = U, A = Vᵀ and lora_alpha = r
that is exactly ΔW = U Vᵀ. Matrices with fewer than r columns are padded with zero columns (which add
nothing), so one r serves every module. PEFT keys adapter tensors by the module path in the loaded model
class: for a Clef release that is `Qwen3_5ForConditionalGeneration` (what the release's own loader builds),
for plain causal LMs `AutoModelForCausalLM`. The module names are checked against that class, built on the
meta device (no weights loaded), before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clef_model.checkpoint import atomic_output, save_tensors
from clef_model.errors import BlazeError
from clef_model.outputs import check_separate
from surgery.patch import Patch

if TYPE_CHECKING:
    from clef_model.release import Release

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _model_class(base: Release) -> Any:  # a transformers model class, or the AutoModelForCausalLM factory
    """The transformers class PEFT will wrap for this base (the one its loader uses)."""
    if getattr(base, "kind", None) == "clef" or getattr(base, "architecture", None) == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def module_names(base: Release) -> set[str]:
    """Names of every nn.Linear of the base's model class (skeleton on the meta device, no weights read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(Path(base.path))
    cls = _model_class(base)
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def export_lora(patch: Patch, base: Release, out_dir: Path, *, force: bool = False) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` equal to the patch; returns the folder.

    `base` is the Release the patch applies to (its config decides the model class and module names).
    """
    from peft import LoraConfig

    names = patch.names()
    if not names:
        raise BlazeError("the patch edits no matrix; there is nothing to export as LoRA.")
    linears = module_names(base)
    unknown = [n for n in names if n not in linears]
    if unknown:
        raise BlazeError(
            f"{unknown[0]} is not a linear module of {_model_class(base).__name__} "
            f"({len(unknown)} such name(s)); this patch cannot be expressed as a LoRA adapter for that model."
        )
    rank = max(patch.rank(n) for n in names)
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        u, v = patch.factors[name]
        pad = rank - u.shape[1]
        if pad:
            u = torch.cat([u, u.new_zeros(u.shape[0], pad)], dim=1)
            v = torch.cat([v, v.new_zeros(v.shape[0], pad)], dim=1)
        tensors[f"base_model.model.{name}.lora_A.weight"] = v.T.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = u.contiguous()
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,  # scaling = lora_alpha / r = 1
        target_modules=names,
        lora_dropout=0.0,
        bias="none",
        task_type=None if getattr(base, "kind", None) == "clef" else "CAUSAL_LM",
        base_model_name_or_path=str(getattr(base, "ref", base.path)),
        revision=getattr(base, "revision", None),
        inference_mode=True,
    )
    check_separate(Path(out_dir), Path(base.path), "the base")  # --force would otherwise replace the base itself
    with atomic_output(Path(out_dir), force=force) as tmp:
        config.save_pretrained(str(tmp))
        # PEFT keeps target_modules as a set: sort it so the same patch always gives the same file
        saved = json.loads((tmp / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        saved["target_modules"] = sorted(saved["target_modules"])
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        save_tensors(tmp / ADAPTER_WEIGHTS, tensors)
        for path in tmp.iterdir():
            path.chmod(0o644)
    return Path(out_dir)
