"""The fast paths (clef_model.fast) compute what the reference transformers / release-code paths compute.

CPU, float32, on the `tiny` fixture (real Qwen3.5 structure, random weights). The CUDA-graph capture
itself only runs on a GPU (scripts/bench checks it there against the same references); these
tests cover the same static-shape code it captures: padded SystemOne forwards and the static-cache
decode step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from clef_model.errors import BlazeError
from clef_model.fast import FastSystemOne, GraphedBackbone, QwenEngine, StaticGreedyDecoder, is_supported
from clef_model.fixtures import build_fixture
from clef_model.trust import import_release_code_file


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny fixture, its release code, and the release's own model + processor (CPU, float32)."""
    folder = build_fixture(tmp_path_factory.mktemp("fast") / "tiny", "tiny", progress=False)
    code = import_release_code_file(folder / "joint_schema_model.py")
    clef, processor = code.load_release_model(folder, device="cpu", dtype=torch.float32)
    return folder, code, clef, processor


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Relative error ‖a − b‖ / ‖b‖ under ``tol`` (float32 rounding differs between sequence lengths)."""
    return bool((a - b).norm() / b.norm() < tol)


def _ids(seed: int, rows: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1900, (rows, length), generator=generator)


@pytest.mark.parametrize("fused_norms,conv", [(False, "conv1d"), (True, "shift")])
def test_hidden_states_match_transformers(release, fused_norms, conv):
    _, _, clef, _ = release
    backbone = clef.language_model
    engine = QwenEngine(backbone, fused_norms=fused_norms, conv=conv)
    ids = _ids(1, 2, 41)
    with torch.inference_mode():
        reference = backbone.model.language_model(input_ids=ids, use_cache=False).last_hidden_state
    ours = engine.hidden_states(ids)
    error = (ours - reference).norm() / reference.norm()
    assert error < 1e-4, f"relative error {error}"


def test_right_padding_leaves_real_positions_unchanged(release):
    engine = QwenEngine(release[2].language_model)
    ids = _ids(2, 1, 29)
    padded = torch.cat([ids, torch.zeros(1, 35, dtype=torch.long)], dim=1)
    assert _close(engine.hidden_states(padded)[:, :29], engine.hidden_states(ids))


def test_graphed_backbone_pads_to_bucket_on_request(release):
    engine = QwenEngine(release[2].language_model)
    backbone = GraphedBackbone(engine, buckets=(16, 64), pad_to_bucket=True)
    assert backbone.bucket_for(17) == 64 and backbone.bucket_for(65) is None
    ids = _ids(3, 1, 17)
    out = backbone(ids)
    assert out.shape == (1, 17, engine.dims.hidden)
    assert _close(out, engine.hidden_states(ids))


def _reference_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fused_norms", [False, True])
def test_greedy_generation_identical_to_transformers(release, fused_norms):
    model = release[2].language_model
    decoder = StaticGreedyDecoder(model, max_len=128, engine=QwenEngine(model, fused_norms=fused_norms))
    ids = _ids(4, 2, 33)
    prompts = [ids[0, :19].tolist(), ids[1].tolist(), ids[0, :3].tolist()]  # ragged batch, one prefill
    fast = decoder.generate(prompts, 12)
    assert [len(row) for row in fast] == [12, 12, 12]
    for prompt, row in zip(prompts, fast, strict=True):
        assert row == _reference_greedy(model, prompt, 12)
    # the same decoder (its static caches reused) gives the same answer again, alone or batched
    assert decoder.generate([prompts[1]], 12) == [fast[1]]


def test_stop_ids_cut_each_row_after_its_first_stop(release):
    model = release[2].language_model
    decoder = StaticGreedyDecoder(model, max_len=128)
    prompt = _ids(5, 1, 12)[0].tolist()
    full = decoder.generate([prompt], 24)[0]
    stop = full[5]
    first = full.index(stop)
    cut = decoder.generate([prompt], 24, stop_ids=[stop], check_every=4)[0]
    assert cut == full[: first + 1]


def test_engine_sees_live_weight_edits(release):
    """Patch.applied edits weights in place; the engine reads the live modules, so it follows."""
    model = copy.deepcopy(release[2].language_model)
    engine = QwenEngine(model)
    ids = _ids(6, 1, 16)
    before = engine.hidden_states(ids).clone()
    weight = model.model.language_model.layers[3].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(0.05 * torch.randn_like(weight))
    with torch.inference_mode():
        reference = model.model.language_model(input_ids=ids, use_cache=False).last_hidden_state
    after = engine.hidden_states(ids)
    assert not _close(after, before, 1e-3)
    assert (after - reference).norm() / reference.norm() < 1e-4


def _long_invoice(target_words: int = 220) -> dict:
    notes = " ".join(f"line {i}: consulting hours billed at the agreed rate." for i in range(target_words // 8))
    return {
        "model": "clef-flash",
        "state": {"invoice": {"vendor": "Acme", "total": 1250.0, "currency": "USD", "status": "overdue",
                              "notes": notes}},
        "questions": {
            "status": {"type": "choice", "instructions": "What is the payment status of this invoice?",
                       "criteria": {"paid": "The invoice has been paid.", "overdue": "Payment is late.",
                                    "draft": "The invoice has not been sent."}},
            "large": {"type": "noul", "instructions": "Is the invoice total above 1000 USD?"},
            "risk": {"type": "score", "instructions": "How risky is this vendor?",
                     "criteria": ["none", "low", "high"]},
        },
    }


def _probabilities(answer: dict) -> list[float]:
    values = []
    for _, item in sorted(answer["answers"].items()):
        values.extend(item.get("probabilities", {}).values())
        values.extend(v for k, v in item.items() if k in ("noul", "score", "confidence"))
    return values


def test_fast_systemone_matches_release(release):
    _, code, clef, processor = release
    reference = lambda request: code.systemone(clef, processor, request)  # noqa: E731
    fast = FastSystemOne(clef.language_model, clef.head, processor.tokenizer, code, reference,
                         buckets=(128, 256, 512, 1024), pad_to_bucket=True)
    request = _long_invoice(100)
    want = reference(request)
    got = fast(request)
    assert got["usage"] == want["usage"] and got["model"] == want["model"]
    assert set(got["answers"]) == set(want["answers"])
    for qid in want["answers"]:
        assert got["answers"][qid]["type"] == want["answers"][qid]["type"]
        assert got["answers"][qid].get("choice") == want["answers"][qid].get("choice")
    assert max(abs(a - b) for a, b in zip(_probabilities(got), _probabilities(want), strict=True)) <= 1e-3
    # requests the fast path does not handle go to the reference, so errors read as the release's
    with pytest.raises(ValueError):
        fast({"model": "clef-flash", "state": {}, "questions": {}})


def test_unsupported_backbone_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    assert not is_supported(llama)
    with pytest.raises(BlazeError, match="reference path"):
        QwenEngine(llama)


def test_a_plain_attention_model_listing_full_attention_layers_is_not_a_hybrid():
    """Qwen2's config lists every layer as "full_attention": no DeltaNet layer, so not this fast path (it used
    to be taken, then failed on the missing linear-attention widths with a warning on every call)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert set(qwen2.config.layer_types) == {"full_attention"}
    assert not is_supported(qwen2)


def test_too_long_generation_is_refused(release):
    decoder = StaticGreedyDecoder(release[2].language_model, max_len=32)
    with pytest.raises(BlazeError, match="max_len"):
        decoder.generate([[5] * 30], 8)


def test_runtime_generate_hook_gives_reference_answers(tiny_runtime, monkeypatch):
    """Runtime.generate through the fast hook (forced on the CPU) returns the reference Generations."""
    prompts = ["What is the speed of light?", "Name a colour.", [{"role": "user", "content": "Count to three."}]]
    monkeypatch.setenv("BLAZE_FAST", "0")
    reference = tiny_runtime.generate(prompts, max_new_tokens=10, batch_size=2)
    monkeypatch.setenv("BLAZE_FAST", "1")
    fast = tiny_runtime.generate(prompts, max_new_tokens=10, batch_size=2)
    assert tiny_runtime.__dict__.get("_fast_decoder") is not None  # the hook really ran
    assert [g.token_ids for g in fast] == [g.token_ids for g in reference]
    assert [(g.text, g.hit_limit, g.new_tokens) for g in fast] == [(g.text, g.hit_limit, g.new_tokens) for g in reference]
    # a chunk of 3 runs padded to a batch of 4 (power-of-two decode states); the padding never leaks out
    padded = tiny_runtime.generate(prompts, max_new_tokens=10, batch_size=4)
    assert [g.token_ids for g in padded] == [g.token_ids for g in reference]
    assert set(tiny_runtime.__dict__["_fast_decoder"]._states) <= {1, 2, 4}


@pytest.mark.parametrize("head", ["release", "vector"])
def test_runtime_systemone_hook_agrees_with_reference(tiny_runtime, monkeypatch, head):
    monkeypatch.setenv("BLAZE_FAST_HEAD", head)
    request = _long_invoice(60)
    monkeypatch.setenv("BLAZE_FAST", "0")
    reference = tiny_runtime.decision_probabilities([request], batch_size=1)[0]
    monkeypatch.setenv("BLAZE_FAST", "1")
    fast = tiny_runtime.decision_probabilities([request], batch_size=1)[0]
    assert tiny_runtime.__dict__.get("_fast_backbone") is not None
    assert fast.keys() == reference.keys()
    worst = max(abs(fast[q][o] - reference[q][o]) for q in reference for o in reference[q])
    assert worst <= 1e-3
    # off by default on the CPU: the hooks decline and the reference path runs
    monkeypatch.delenv("BLAZE_FAST")
    from clef_model import fast as fast_module

    assert fast_module.enabled(tiny_runtime) is False


def test_vectorised_head_matches_release_head(release):
    """head_logits (all questions at once, no host syncs) equals the release's JointSchemaHead loops."""
    from canaries.suites import default_decision_suite
    from clef_model.fast import head_logits, head_plan, known_head

    _, code, clef, processor = release
    assert known_head(code)
    tokenizer = processor.tokenizer
    requests = [_long_invoice(30)] + [{k: r[k] for k in ("model", "state", "questions")}
                                     for r in default_decision_suite()[:6]]
    backbone = clef.language_model
    weight = backbone.get_output_embeddings().weight
    with torch.inference_mode():
        for request in requests:
            record = code.encode_record(tokenizer, request)
            batch = code.collate_records([record], tokenizer.pad_token_id, torch.device("cpu"))
            hidden = backbone.model.language_model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
            want = clef.head(hidden, batch["input_ids"], batch["attention_mask"], batch["records"], weight)[0]
            got = head_logits(clef.head, hidden[0], head_plan(record, torch.device("cpu")), weight)
            assert [g.shape for g in got] == [w.shape for w in want]
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, atol=1e-4, rtol=1e-4), (g, w)


def test_runtime_hook_failure_falls_back_to_reference(tiny_runtime, monkeypatch):
    """A fast-path failure turns the hooks off for that runtime and the reference answers still come."""
    from clef_model import fast as fast_module

    monkeypatch.setenv("BLAZE_FAST", "1")

    def broken(*_a, **_k):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(fast_module.StaticGreedyDecoder, "generate", broken)
    tiny_runtime.__dict__.pop("_fast_decoder", None)
    with pytest.warns(UserWarning, match="fast path disabled"):
        answer = tiny_runtime.generate(["Name a colour."], max_new_tokens=4)
    assert answer[0].new_tokens >= 1 and "simulated" in tiny_runtime.__dict__["_fast_failed"]
    assert fast_module.enabled(tiny_runtime) is False
    tiny_runtime.__dict__.pop("_fast_supported")
    tiny_runtime.__dict__.pop("_fast_failed")


def test_vectorised_head_only_on_request(release, monkeypatch):
    """The release's own head is the default (bit-compatible); BLAZE_FAST_HEAD=vector opts in."""
    from clef_model.fast import vector_head_requested

    code = release[1]
    monkeypatch.delenv("BLAZE_FAST_HEAD", raising=False)
    assert vector_head_requested(code) is False
    monkeypatch.setenv("BLAZE_FAST_HEAD", "vector")
    assert vector_head_requested(code) is True
    assert vector_head_requested(None) is False  # unknown (e.g. trusted third-party) release code: never


def test_compiled_backbone_only_on_request(tiny_runtime, monkeypatch):
    """BLAZE_FAST_COMPILE=1 routes SystemOne through torch.compile's wrapper of the engine forward.

    torch.compile is replaced by a recording pass-through (compiling on the CPU needs a C++ toolchain and
    minutes); the GPU figures and the answer drift of the real compile are in BENCHMARKS.md, run J.
    """

    compiled = []

    def recording_compile(fn, **options):
        compiled.append((fn.__name__, options))
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    request = _long_invoice(60)
    monkeypatch.setenv("BLAZE_FAST", "0")
    reference = tiny_runtime.decision_probabilities([request], batch_size=1)[0]
    monkeypatch.setenv("BLAZE_FAST", "1")
    monkeypatch.delenv("BLAZE_FAST_COMPILE", raising=False)
    tiny_runtime.__dict__.pop("_fast_backbone", None)
    tiny_runtime.decision_probabilities([request], batch_size=1)
    assert compiled == []  # off by default
    monkeypatch.setenv("BLAZE_FAST_COMPILE", "1")
    tiny_runtime.__dict__.pop("_fast_backbone", None)
    fast = tiny_runtime.decision_probabilities([request], batch_size=1)[0]
    assert [name for name, _ in compiled] == ["_run"] and compiled[0][1]["dynamic"] is False
    assert tiny_runtime.__dict__["_fast_backbone"].engine is not tiny_runtime.__dict__.get("_fast_engine")
    worst = max(abs(fast[q][o] - reference[q][o]) for q in reference for o in reference[q])
    assert worst <= 1e-3  # with the pass-through, the same forward as the exact path
    tiny_runtime.__dict__.pop("_fast_backbone", None)


def test_text_decoder_is_one_lookup_also_through_a_peft_wrapper(release):
    """clef_model.backbone.text_decoder finds the decoder stack; the fast path's text_parts uses it."""
    from clef_model.backbone import text_decoder
    from clef_model.fast import text_parts

    backbone = release[2].language_model
    stack = backbone.model.language_model

    class Wrapped(torch.nn.Module):  # the shape of a PEFT model: the real model behind get_base_model()
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def get_base_model(self) -> torch.nn.Module:
            return self.inner

    assert text_decoder(backbone) is stack
    assert text_decoder(Wrapped(backbone)) is stack
    assert text_parts(Wrapped(backbone)) == (stack, backbone.get_output_embeddings())
