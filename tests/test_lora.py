"""surgery.lora.export_lora: PEFT loads the adapter onto the base and reproduces the variant's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clef_model.checkpoint import CheckpointReader, sha256_file
from clef_model.errors import BlazeError
from clef_model.release import resolve_release
from surgery.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_lora
from surgery.patch import Patch
from surgery.write import write_variant

WRITERS = ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight")


def _patch(release, layers, strength=0.2, ranks=(1, 2)) -> Patch:
    """Random deltas on the residual writers of `layers`, ranks alternating over `ranks` (to test padding)."""
    reader = CheckpointReader(release.path)
    gen = torch.Generator().manual_seed(3)
    names = sorted(n[: -len(".weight")] for n in reader.names()
                   if n.startswith("model.") and n.endswith(WRITERS) and any(f".layers.{i}." in n for i in layers))
    factors = {}
    for i, name in enumerate(names):
        weight = reader.tensor(f"{name}.weight").float()
        k = ranks[i % len(ranks)]
        u, v = torch.randn(weight.shape[0], k, generator=gen), torch.randn(weight.shape[1], k, generator=gen)
        factors[name] = (u * strength * float(weight.norm()) / float((u @ v.T).norm()), v)
    return Patch(factors, None, {})


def _compare(model_cls, base, patch, tmp_path: Path, input_ids: torch.Tensor) -> None:
    from peft import PeftModel

    variant = write_variant(base, patch, tmp_path / "variant", progress=False)
    adapter = export_lora(patch, base, tmp_path / "lora")
    assert sorted(p.name for p in adapter.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert config["r"] == config["lora_alpha"] == max(patch.rank(n) for n in patch.names())
    assert config["target_modules"] == patch.names()

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=input_ids).logits.float()

    base_model = model_cls.from_pretrained(base.path, dtype=torch.float32).eval()
    base_logits = logits(base_model)
    variant_logits = logits(model_cls.from_pretrained(variant, dtype=torch.float32).eval())
    peft_model = PeftModel.from_pretrained(base_model, adapter).eval()
    lora_logits = logits(peft_model)
    # the variant stores W + UVᵀ rounded to bf16; the adapter adds UVᵀ exactly: bf16-level agreement
    scale = float(variant_logits.abs().max())
    assert float((lora_logits - variant_logits).abs().max()) <= 2e-2 * scale
    assert float((base_logits - variant_logits).abs().max()) > 10 * float((lora_logits - variant_logits).abs().max())
    # deterministic files
    again = export_lora(patch, base, tmp_path / "lora2")
    assert all(sha256_file(adapter / n) == sha256_file(again / n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def test_lora_on_the_tiny_clef_release(tiny_release, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    base = resolve_release(tiny_release)
    patch = _patch(base, layers=(0, 1, 2, 3))
    ids = torch.arange(5, 45).reshape(2, 20)
    _compare(Qwen3_5ForConditionalGeneration, base, patch, tmp_path, ids)


def test_lora_on_a_tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path / "llama"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    base = resolve_release(folder)
    assert base.kind == "causal_lm" and base.architecture == "llama"
    patch = _patch(base, layers=(0, 1, 2))
    _compare(LlamaForCausalLM, base, patch, tmp_path, torch.arange(1, 33).reshape(2, 16))


def test_lora_refuses_names_that_are_not_linear_modules(tiny_release, tmp_path):
    base = resolve_release(tiny_release)
    reader = CheckpointReader(base.path)
    width = reader.shape("model.language_model.norm.weight")[0]
    patch = Patch({"model.language_model.norm": (torch.ones(width, 1), torch.ones(1, 1))})
    with pytest.raises(BlazeError, match="not a linear module"):
        export_lora(patch, base, tmp_path / "lora")
    assert not (tmp_path / "lora").exists()


def test_cli_apply_exports_lora(tiny_release, tmp_path):
    from click.testing import CliRunner

    from variants.cli import main

    base = resolve_release(tiny_release)
    patch = _patch(base, layers=(1,))
    patch.save(tmp_path / "delta.safetensors")
    result = CliRunner().invoke(main, ["apply", str(tmp_path / "delta.safetensors"), "--base", str(base.path),
                                       "--out", str(tmp_path / "v"), "--export-lora", str(tmp_path / "lora"),
                                       "--max-shard-size", "200KB"])
    assert result.exit_code == 0, result.output
    assert "wrote LoRA adapter" in result.output
    reader = CheckpointReader(tmp_path / "lora" / ADAPTER_WEIGHTS)
    for name in patch.names():
        u, v = patch.factors[name]
        assert torch.equal(reader.tensor(f"base_model.model.{name}.lora_B.weight")[:, : u.shape[1]], u)
        assert torch.equal(reader.tensor(f"base_model.model.{name}.lora_A.weight")[: v.shape[1]], v.T)
    shards = {p.name for p in (tmp_path / "v").glob("model-*.safetensors")}
    assert len(shards) > 1  # --max-shard-size took effect
