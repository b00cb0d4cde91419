"""Runtime: systemone equals the release's own, batching agrees, generate is deterministic, module access."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from clef_model.errors import BlazeError
from clef_model.runtime import Generation, Runtime
from clef_model.trust import import_release_code_file

INVOICE = {
    "model": "clef-flash",
    "state": {"invoice": "INV-2041", "issued": "3 March", "due": "2 April", "amount": 1250.0, "paid": 0},
    "questions": {
        "overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
        "status": {
            "type": "choice",
            "instructions": "Status of the invoice",
            "criteria": {"paid": "fully paid", "overdue": "past due", "disputed": "in dispute", "pending": "not due"},
        },
        "urgency": {"type": "score", "instructions": "How urgent is a reminder?", "criteria": ["low", "medium", "high"]},
        "plan": {"type": "noul", "instructions": "Did the customer ask for a payment plan?", "criteria": None},
    },
}
TICKET = {
    "model": "clef-flash",
    "state": "Support ticket 88231: My password reset email never arrives. I checked the spam folder twice.",
    "questions": {
        "sentiment": {
            "type": "score",
            "instructions": "Rate the sentiment",
            "criteria": ["very negative", "negative", "neutral", "positive", "very positive"],
        },
        "category": {
            "type": "choice",
            "instructions": "",
            "criteria": {"account": "account access", "bug": "bug report", "billing": "billing question"},
        },
    },
}
SHORT = {"model": "m", "state": {"x": 1}, "questions": {"q": {"type": "noul", "instructions": "Is x one?"}}}


def image_request() -> dict:
    image = Image.new("RGB", (80, 48))
    image.putdata([((x * 7) % 256, (y * 11) % 256, (x * y) % 256) for y in range(48) for x in range(80)])
    return {
        "model": "clef-flash",
        "state": {"note": "photo of the delivered parcel"},
        "images": [image],
        "questions": {
            "damaged": {"type": "noul", "instructions": "Is the parcel damaged?"},
            "colour": {"type": "choice", "instructions": "Main colour", "criteria": {"red": "red", "blue": "blue"}},
        },
    }


@pytest.fixture(scope="module")
def reference(tiny_release: Path):
    """The release's own code and model, loaded independently of blaze's Runtime."""
    module = import_release_code_file(tiny_release / "joint_schema_model.py")
    model, processor = module.load_release_model(tiny_release, device="cpu", dtype=torch.float32)
    return module, model, processor


@pytest.mark.parametrize("request_body", [INVOICE, TICKET, SHORT], ids=["invoice", "ticket", "short"])
def test_systemone_equals_release(tiny_runtime: Runtime, reference, request_body: dict) -> None:
    module, model, processor = reference
    expected = module.systemone(model, processor, request_body)
    assert tiny_runtime.systemone(request_body) == expected
    types = {answer["type"] for answer in expected["answers"].values()}
    assert types <= {"noul", "choice", "score"}


def test_all_three_types_answered(tiny_runtime: Runtime) -> None:
    answers = tiny_runtime.systemone(INVOICE)["answers"]
    assert [answers[q]["type"] for q in ("overdue", "status", "urgency", "plan")] == ["noul", "choice", "score", "noul"]
    assert set(answers["status"]["probabilities"]) == {"paid", "overdue", "disputed", "pending"}


def test_image_request_equals_release(tiny_runtime: Runtime, reference) -> None:
    module, model, processor = reference
    request = image_request()
    expected = module.systemone(model, processor, request)
    got = tiny_runtime.systemone(request)
    assert got == expected
    text_only = {k: v for k, v in request.items() if k != "images"}
    assert got["usage"]["input_tokens"] > tiny_runtime.systemone(text_only)["usage"]["input_tokens"]


def test_batch_of_mixed_requests_matches_unbatched(tiny_runtime: Runtime, reference) -> None:
    module, model, processor = reference
    requests = [INVOICE, image_request(), TICKET, SHORT, INVOICE]
    batched = tiny_runtime.systemone_batch(requests, batch_size=8)
    for request, response in zip(requests, batched, strict=True):
        expected = module.systemone(model, processor, request)
        assert response["usage"] == expected["usage"]
        assert response["answers"].keys() == expected["answers"].keys()
        for question_id, answer in expected["answers"].items():
            got = response["answers"][question_id]
            assert got["type"] == answer["type"]
            for key in ("noul", "score", "confidence"):
                if key in answer:
                    assert got[key] == pytest.approx(answer[key], abs=1e-3)
            for option, p in (answer.get("probabilities") or {}).items():
                assert got["probabilities"][option] == pytest.approx(p, abs=1e-3)
    unrounded = tiny_runtime.decision_probabilities(requests, batch_size=2)
    single = [tiny_runtime.decision_probabilities([r], batch_size=1)[0] for r in requests]
    for a, b in zip(unrounded, single, strict=True):
        for question_id in a:
            for option in a[question_id]:
                assert a[question_id][option] == pytest.approx(b[question_id][option], abs=1e-3)
        assert sum(a[next(iter(a))].values()) == pytest.approx(1.0, abs=1e-5)


def test_invalid_requests_raise_release_errors(tiny_runtime: Runtime) -> None:
    with pytest.raises(ValueError, match="model and state are required"):
        tiny_runtime.systemone({"state": 1, "questions": {"q": {"type": "noul"}}})
    with pytest.raises(ValueError, match="at least one question"):
        tiny_runtime.systemone({"model": "m", "state": 1, "questions": {}})
    with pytest.raises(ValueError, match="type must be"):
        tiny_runtime.systemone({"model": "m", "state": 1, "questions": {"q": {"type": "rank"}}})
    with pytest.raises(ValueError, match="criteria must not be empty"):
        tiny_runtime.systemone({"model": "m", "state": 1, "questions": {"q": {"type": "choice", "criteria": {}}}})


def test_generate_is_deterministic_batched_and_varied(tiny_runtime: Runtime) -> None:
    prompts = ["What is the speed of light?", "Name three colours.", [{"role": "user", "content": "Hi"}]]
    first = tiny_runtime.generate(prompts, max_new_tokens=12, batch_size=3)
    second = tiny_runtime.generate(prompts, max_new_tokens=12, batch_size=1)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert [g.text for g in first] == [g.text for g in second]
    for generation in first:
        assert isinstance(generation, Generation)
        assert generation.new_tokens == len(generation.token_ids)
        assert generation.hit_limit == (generation.new_tokens == 12)
        assert len(set(generation.token_ids)) > 3  # random weights still give varied tokens
    assert first[0].prompt_tokens == len(tiny_runtime.chat_ids(prompts[0]))


def test_chat_ids_use_release_template_without_thinking(tiny_runtime: Runtime) -> None:
    text = tiny_runtime.tokenizer.decode(tiny_runtime.chat_ids("Hello", system="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_generate_cache_on_matches_cache_off(tiny_runtime: Runtime) -> None:
    ids = torch.tensor([tiny_runtime.chat_ids("Explain rain.")])
    cached = tiny_runtime.model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = tiny_runtime.model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert tiny_runtime.model.config.use_cache is True
    assert cached.tolist() == uncached.tolist()


def test_module_access_uses_on_disk_names(tiny_runtime: Runtime) -> None:
    on_disk = tiny_runtime.release.weight_map()
    linears = tiny_runtime.named_linears()
    assert all(name + ".weight" in on_disk for name in linears)
    assert "model.language_model.layers.3.mlp.down_proj" in linears
    assert "model.language_model.layers.0.linear_attn.out_proj" in linears
    assert "model.language_model.layers.3.self_attn.o_proj" in linears
    assert linears["lm_head"] is tiny_runtime.lm_head()
    layers = tiny_runtime.decoder_layers()
    assert len(layers) == 8
    assert layers[3].mlp.down_proj is linears["model.language_model.layers.3.mlp.down_proj"]
    # the decision head reads the same backbone: editing a linear changes decisions, restoring restores
    before = tiny_runtime.decision_probabilities([SHORT])[0]
    weight = tiny_runtime.lm_head().weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(3.0)
    try:
        changed = tiny_runtime.decision_probabilities([SHORT])[0]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert changed["q"]["true"] != pytest.approx(before["q"]["true"], abs=1e-6)
    assert tiny_runtime.decision_probabilities([SHORT])[0] == before


def test_text_model_returns_hidden_states(tiny_runtime: Runtime) -> None:
    ids = torch.tensor([tiny_runtime.chat_ids("Hello")])
    out = tiny_runtime.text_model()(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.last_hidden_state.shape == (1, ids.shape[1], 64)


def test_plain_causal_lm_refuses_systemone(tmp_path: Path, tiny_release: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_release)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    runtime = Runtime.load(str(tmp_path / "llama"), device="cpu")
    assert not runtime.is_clef and runtime.release.architecture == "llama"
    with pytest.raises(BlazeError, match="plain causal LM"):
        runtime.systemone(SHORT)
    generations = runtime.generate(["Hello"], max_new_tokens=4)
    assert generations[0].new_tokens <= 4
    assert "model.layers.1.mlp.down_proj" in runtime.named_linears()


@pytest.mark.slow
def test_smollm2_embedded_generates_same_text_twice(smollm2_path: Path) -> None:
    from clef_model.checkpoint import CheckpointReader

    reader = CheckpointReader(smollm2_path)
    assert len(reader.shard_files()) >= 2
    assert {reader.dtype(name) for name in reader.names()} == {"BF16"}
    assert "model.layers.0.mlp.down_proj.weight" in reader.names()
    runtime = Runtime.load("smollm2", device="cpu")
    assert runtime.release.path == smollm2_path and runtime.release.architecture == "llama"
    first = runtime.generate(["What is the capital of France?"], max_new_tokens=16)[0]
    second = runtime.generate(["What is the capital of France?"], max_new_tokens=16)[0]
    assert first.text == second.text and first.token_ids == second.token_ids
    assert "Paris" in first.text
    assert first.new_tokens > 0 and first.prompt_tokens == len(runtime.chat_ids("What is the capital of France?"))
    assert "model.layers.29.mlp.down_proj" in runtime.named_linears()


def test_cli_help_lists_commands() -> None:
    from click.testing import CliRunner

    from variants.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("generate", "systemone", "fixture"):
        assert command in result.output


def test_cli_systemone_and_generate(tiny_release: Path, tiny_runtime: Runtime, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from variants.cli import main

    request_file = tmp_path / "request.json"
    request_file.write_text(json.dumps(INVOICE))
    runner = CliRunner()
    result = runner.invoke(main, ["systemone", str(tiny_release), str(request_file), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1]) == tiny_runtime.systemone(INVOICE)

    request_file.write_text(json.dumps([INVOICE, SHORT]))
    result = runner.invoke(main, ["systemone", str(tiny_release), str(request_file), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout.strip().splitlines()[-1])) == 2

    request_file.write_text(json.dumps({"model": "m", "state": 1, "questions": {}}))
    result = runner.invoke(main, ["systemone", str(tiny_release), str(request_file), "--device", "cpu"])
    assert result.exit_code == 2 and "at least one question" in result.output

    result = runner.invoke(main, ["generate", str(tiny_release), "Hello there", "--max-new-tokens", "6", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    expected = tiny_runtime.generate(["Hello there"], max_new_tokens=6)[0].text
    assert result.stdout.strip().splitlines()[-1] == expected


def test_cli_fixture_and_offline_hub_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from variants.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["fixture", str(tmp_path / "fx"), "--preset", "tiny", "--num-layers", "4"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fx" / "joint_head.safetensors").is_file()
    result = runner.invoke(main, ["fixture", str(tmp_path / "fx")])
    assert result.exit_code == 2 and "not empty" in result.output
    result = runner.invoke(main, ["generate", "someone/not-cached-model", "Hi"])
    assert result.exit_code == 2 and "local folder" in result.output


def test_qwen35_checkpoint_without_head_is_a_causal_lm(tiny_release: Path, tiny_runtime: Runtime, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "qwen35"
    shutil.copytree(tiny_release, folder)
    for name in ("joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py"):
        (folder / name).unlink()
    runtime = Runtime.load(str(folder), device="cpu")
    assert (runtime.release.kind, runtime.release.architecture) == ("causal_lm", "qwen3_5")
    assert type(runtime.model).__name__ == "Qwen3_5ForCausalLM"
    # same on-disk names as the Clef backbone, and the same greedy tokens
    assert set(runtime.named_linears()) == {n for n in tiny_runtime.named_linears() if not n.startswith("model.visual.")}
    prompt = ["Explain rain."]
    assert runtime.generate(prompt, max_new_tokens=6)[0].token_ids == tiny_runtime.generate(prompt, max_new_tokens=6)[0].token_ids
    with pytest.raises(BlazeError, match="plain causal LM"):
        runtime.systemone(SHORT)


def test_tiny_generations_are_printable(tiny_runtime: Runtime) -> None:
    for generation in tiny_runtime.generate(["What is the speed of light?", "Name three colours."], max_new_tokens=24):
        assert all(ch.isprintable() or ch in "\n\t" for ch in generation.text) and "\ufffd" not in generation.text


def test_default_dtype_float32_for_small_plain_models_on_cuda(tmp_path):
    """float32 on the CPU; on CUDA float32 only for a plain chat model of ≤ 4 GB of weights (bfloat16 answers
    move with the batch alone); Clef and larger models keep bfloat16."""
    import torch

    from clef_model.release import Release
    from clef_model.runtime import FLOAT32_ON_CUDA_MAX_BYTES, default_dtype

    def release(name: str, kind: str, size: int) -> Release:
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "model.safetensors", "wb") as handle:
            handle.truncate(size)  # sparse: no bytes written
        return Release(path=folder, ref=name, revision=None, kind=kind, architecture="llama")

    small, large = release("small", "causal_lm", 10**6), release("large", "causal_lm", FLOAT32_ON_CUDA_MAX_BYTES + 1)
    clef = release("clef", "clef", 10**6)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_dtype(cuda, small) == torch.float32
    assert default_dtype(cuda, large) == torch.bfloat16
    assert default_dtype(cuda, clef) == torch.bfloat16
    assert default_dtype(cuda) == torch.bfloat16
    assert {default_dtype(cpu, r) for r in (small, large, clef, None)} == {torch.float32}
