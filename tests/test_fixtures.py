"""The fixture builder: exact release layout, real Qwen3.5 structure, deterministic, loadable by the release code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clef_model.checkpoint import CheckpointReader, sha256_file
from clef_model.errors import BlazeError
from clef_model.fixtures import SPECIAL_TOKENS, build_fixture
from clef_model.trust import KNOWN_RELEASE_CODE, import_release_code_file

RELEASE_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "joint_head.safetensors",
    "joint_head_config.json",
    "joint_schema_model.py",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "processor_config.json",
    "LICENSE",
]


def test_tiny_has_release_layout(tiny_release: Path) -> None:
    for name in RELEASE_FILES:
        assert (tiny_release / name).is_file(), name
    index = json.loads((tiny_release / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert all((tiny_release / shard).is_file() for shard in shards)
    reader = CheckpointReader(tiny_release)
    assert index["metadata"]["total_size"] == reader.total_bytes()
    assert sha256_file(tiny_release / "joint_schema_model.py") in KNOWN_RELEASE_CODE


def test_tiny_has_qwen35_structure(tiny_release: Path) -> None:
    config = json.loads((tiny_release / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["num_hidden_layers"] >= 4
    assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    names = set(CheckpointReader(tiny_release).names())
    prefix = "model.language_model.layers"
    assert f"{prefix}.0.linear_attn.in_proj_qkv.weight" in names
    assert f"{prefix}.3.self_attn.o_proj.weight" in names
    q = CheckpointReader(tiny_release).shape(f"{prefix}.3.self_attn.q_proj.weight")
    assert q[0] == 2 * text["num_attention_heads"] * text["head_dim"]  # query + output gate
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    assert any(n.startswith("model.visual.blocks.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert CheckpointReader(tiny_release).dtype("lm_head.weight") == "BF16"


def test_tokenizer_is_trained_bpe_with_qwen_specials(tiny_release: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_release)
    for token in SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert len(ids) == 1, token
    model = json.loads((tiny_release / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and len(model["merges"]) > 1000
    text = "The invoice is overdue and the customer asked for a payment plan."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) < len(text) / 2.5  # merges make tokens of whole words, not bytes
    assert tokenizer.decode(ids) == text


def test_chat_template_honours_enable_thinking(tiny_release: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_release)
    messages = [{"role": "user", "content": "Hi"}]
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n<think>\n")


def test_release_code_loads_tiny_and_head_is_not_uniform(tiny_release: Path) -> None:
    module = import_release_code_file(tiny_release / "joint_schema_model.py")
    model, processor = module.load_release_model(tiny_release, device="cpu", dtype=torch.float32)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    head = model.head
    assert head.residual_gate.item() != 0 and head.joint_logit_scale.item() != 0
    request = {
        "model": "clef",
        "state": {"invoice": "INV-2041", "due": "2 April", "paid": False},
        "questions": {
            "status": {
                "type": "choice",
                "instructions": "Status of the invoice",
                "criteria": {"paid": "fully paid", "overdue": "past due", "disputed": "in dispute"},
            }
        },
    }
    answer = module.systemone(model, processor, request)["answers"]["status"]
    probabilities = list(answer["probabilities"].values())
    assert max(probabilities) - min(probabilities) > 0.02


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    first = build_fixture(tmp_path / "a", "tiny", seed=3, num_layers=4)
    second = build_fixture(tmp_path / "b", "tiny", seed=3, num_layers=4)
    third = build_fixture(tmp_path / "c", "tiny", seed=4, num_layers=4)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert sha256_file(first / name) == sha256_file(second / name), name
    assert sha256_file(first / "model-00001-of-00004.safetensors") != sha256_file(
        third / "model-00001-of-00004.safetensors"
    ) or sha256_file(first / "joint_head.safetensors") != sha256_file(third / "joint_head.safetensors")
    config = json.loads((first / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 4


def test_refuses_non_empty_output_and_unknown_preset(tiny_release: Path, tmp_path: Path) -> None:
    with pytest.raises(BlazeError, match="not empty"):
        build_fixture(tiny_release, "tiny")
    with pytest.raises(BlazeError, match="preset"):
        build_fixture(tmp_path / "x", "huge")


def test_9b_layout_matches_the_real_release_sizes() -> None:
    from clef_model.checkpoint import tensor_nbytes
    from clef_model.fixtures import fixture_layout

    layout = fixture_layout("9b")
    total = sum(tensor_nbytes(dtype, shape) for _, dtype, shape in layout)
    assert total == 19_306_216_416  # Clef-Flash's published index total_size
    loaded = [(n, s) for n, _, s in layout if not n.startswith("mtp.")]
    assert sum(torch.Size(s).numel() for _, s in loaded) == 9_409_813_744  # the real release's shapes
    shapes = dict((n, s) for n, _, s in layout)
    prefix = "model.language_model.layers"
    assert shapes[f"{prefix}.3.self_attn.q_proj.weight"] == (8192, 4096)
    assert shapes[f"{prefix}.3.self_attn.o_proj.weight"] == (4096, 4096)
    assert shapes[f"{prefix}.0.linear_attn.out_proj.weight"] == (4096, 4096)
    assert shapes[f"{prefix}.0.mlp.down_proj.weight"] == (4096, 12288)
    assert shapes["lm_head.weight"] == (248320, 4096)
    assert f"{prefix}.31.self_attn.o_proj.weight" in shapes and f"{prefix}.32.mlp.down_proj.weight" not in shapes
    assert sum(1 for n in shapes if n.startswith("model.visual.blocks.") and n.endswith("norm1.weight")) == 27
    two = fixture_layout("9b", num_layers=2)
    assert not any(n.startswith(f"{prefix}.2.") for n, _, _ in two)
    assert any(n.startswith("mtp.") for n, _, _ in two)
