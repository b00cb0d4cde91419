#!/usr/bin/env python3
"""GPU benchmarks of issue 6 on one H200: blaze edit, blaze canary, SystemOne latency, generate.

Writes ``results.json`` and ``results.md`` to ``--out`` (plus ``log.txt``); prints a short table last.
Sections (``--sections``, comma separated, run in this order):

- ``env``       versions, GPU, which Gated DeltaNet kernel transformers uses, measured ceilings
                (bf16 matmul TFLOP/s, device copy TB/s).
- ``systemone`` SystemOne latency on the model card's invoice request with its state padded to
                ~``--s1-tokens`` tokens: stock release path vs ``clef_model.fast.FastSystemOne`` (CUDA
                graph per length bucket); median / p95 over ``--s1-repeats`` after warm-up; time split
                (encode, backbone, head); answer agreement (max |Δp|).
- ``generate``  free-form greedy generation, ``--gen-tokens`` new tokens, no early stop: stock
                ``generate`` (KV cache on) vs ``clef_model.fast.StaticGreedyDecoder`` at batch 1 and at
                ``--gen-batches``; token agreement with the stock path.
- ``edit``      ``blaze fixture --preset 9b`` on local disk, then the whole ``blaze edit`` (default
                verbosity recipe) in-process with the stages timed: load, statistics (tokens/s), solve,
                write, total.
- ``canary``    the whole ``blaze canary VARIANT --against BASE`` with default suites, timed.

``systemone``/``generate`` run on ``--model`` (a release folder, e.g. the ``edit`` fixture) or, with
``--model random9b``, on a random-weight model with the real 9B text shapes built in GPU memory (no
disk; tokenizer and head from the fixture builder).

Example (what BENCHMARKS.md records):
    python scripts/bench_gpu.py --out $OUT --workdir /tmp/bench --sections env,systemone,generate --model random9b
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RESULTS: dict[str, Any] = {}
DEVICE = "cuda"  # --device cpu runs a smoke test of the script itself on the tiny fixture
LOG: list[str] = []


def say(message: str) -> None:
    """Print and keep a line for log.txt."""
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    LOG.append(line)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) with the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"median_ms": round(statistics.median(ms), 2), "p95_ms": round(pct(ms, 0.95), 2),
            "min_ms": round(min(ms), 2), "n": len(ms)}


@contextlib.contextmanager
def fast_setting(value: str | None):
    """Set BLAZE_FAST (None: unset, i.e. the default) for the block: "0" = stock reference paths."""
    before = os.environ.get("BLAZE_FAST")
    if value is None:
        os.environ.pop("BLAZE_FAST", None)
    else:
        os.environ["BLAZE_FAST"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("BLAZE_FAST", None)
        else:
            os.environ["BLAZE_FAST"] = before


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ env
def section_env(args) -> None:
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import fla  # noqa: F401

        info["fla"] = getattr(fla, "__version__", "importable")
    except Exception as error:  # noqa: BLE001
        info["fla"] = f"not importable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        _, dt = timed(lambda: [a @ b for _ in range(10)])
        info["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / dt / 1e12, 1)
        src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
        dst = torch.empty_like(src)
        dst.copy_(src)
        _, dt = timed(lambda: [dst.copy_(src) for _ in range(5)])
        info["copy_tb_s"] = round(5 * 2 * src.numel() * 2 / dt / 1e12, 2)
        del a, b, src, dst
        free_gpu()
    RESULTS["env"] = info
    say(f"env: {json.dumps(info)}")


def kernel_report(backbone: torch.nn.Module) -> dict[str, Any]:
    """Which Gated DeltaNet / conv implementation the transformers module resolved to (best effort)."""
    import importlib

    report: dict[str, Any] = {"fla_imported": "fla" in sys.modules}
    layer = next((m for m in backbone.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    module = importlib.import_module(type(layer).__module__) if layer is not None else None
    for owner, label in ((layer, "layer"), (module, "module")):
        if owner is None:
            continue
        for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update", "torch_chunk_gated_delta_rule"):
            fn = getattr(owner, name, None)
            if fn is not None:
                inner = getattr(fn, "__wrapped__", fn)
                report[f"{label}.{name}"] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}" + (
                    f" (wraps {getattr(inner, '__module__', '?')})" if inner is not fn else "")
    attn = next((m for m in backbone.modules() if type(m).__name__.endswith("Attention")
                 and hasattr(m, "config")), None)
    if attn is not None:
        report["attn_implementation"] = getattr(attn.config, "_attn_implementation", None)
    return report


# --------------------------------------------------------------------------------------------- models
class Loaded:
    """What the SystemOne/generate sections need: backbone, head, tokenizer, release code, reference fn."""

    def __init__(self, backbone, head, tokenizer, code, reference, processor=None, runtime=None, label=""):
        self.backbone, self.head, self.tokenizer, self.code = backbone, head, tokenizer, code
        self.reference, self.processor, self.runtime, self.label = reference, processor, runtime, label


def _tiny_folder(workdir: Path) -> Path:
    from clef_model.fixtures import build_fixture

    folder = workdir / "tiny"
    if not folder.exists():
        build_fixture(folder, "tiny", progress=False)
    return folder


def load_random9b(workdir: Path) -> Loaded:
    """A random-weight model with the real 9B text shapes, built directly in GPU memory (bf16).

    Scales follow the fixture builder's rules, so activations behave like the `9b` fixture's.
    """
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from clef_model import fixtures
    from clef_model.trust import import_release_code_file

    tiny = _tiny_folder(workdir)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in fixtures.SPECIAL_TOKENS}
    config, head_config = fixtures._configs("9b", None, ids)  # the fixture builder's own 9b shapes
    config["vision_config"].update(depth=1)  # the text path never runs the vision tower
    code = import_release_code_file(tiny / "joint_schema_model.py")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            backbone = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config)).eval()
    finally:
        torch.set_default_dtype(previous)
    live = len(tokenizer)
    with torch.no_grad():
        for name, param in backbone.named_parameters():
            kind, a, b = fixtures._init_rule(name, tuple(param.shape))
            if kind == "log_uniform":
                param.copy_(torch.empty(param.shape, device="cuda").uniform_(a, b).log_())
            else:
                param.normal_(a, b) if b > 0 else param.fill_(a)
            if name.endswith(("lm_head.weight", "embed_tokens.weight")):
                param[live:] = 0
        for module in backbone.modules():  # non-persistent rotary buffers: recompute in float32
            if type(module).__name__ == "Qwen3_5TextRotaryEmbedding":
                inv, _ = module.compute_default_rope_parameters(module.config, device="cuda")
                module.inv_freq = inv
    backbone.config.use_cache = False  # as the release loader leaves it
    head = code.JointSchemaHead(**head_config).to(device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        head.prior_logit_scale.fill_(1.2)
        head.joint_logit_scale.fill_(2.5)
        head.residual_gate.fill_(0.5)
    clef = code.ClefModel(backbone, head).eval()

    class _Processor:  # encode_record only needs .tokenizer for text-only requests
        pass

    processor = _Processor()
    processor.tokenizer = tokenizer
    reference = lambda request: code.systemone(clef, processor, request)  # noqa: E731
    return Loaded(backbone, head, tokenizer, code, reference, processor=processor, label="random9b (in memory)")


def load_release(folder: Path) -> Loaded:
    """A release folder through clef_model.runtime.Runtime when it exists, else the release loader."""
    try:
        from clef_model.runtime import Runtime
    except ImportError:
        Runtime = None
    if Runtime is not None:
        runtime = Runtime.load(str(folder), device=DEVICE)
        code = getattr(runtime, "release_code", None)
        head = getattr(runtime, "head", None)
        clef = getattr(runtime, "clef", None) or getattr(runtime, "clef_model", None)
        if head is None and clef is not None:
            head = clef.head
        if code is None:
            from clef_model.trust import load_release_code

            code = load_release_code(runtime.release)
        return Loaded(runtime.model, head, runtime.tokenizer, code, runtime.systemone,
                      processor=runtime.processor, runtime=runtime, label=f"Runtime.load({folder.name})")
    from clef_model.trust import import_release_code_file

    code = import_release_code_file(folder / "joint_schema_model.py")
    clef, processor = code.load_release_model(folder, device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    reference = lambda request: code.systemone(clef, processor, request)  # noqa: E731
    return Loaded(clef.language_model, clef.head, processor.tokenizer, code, reference, processor=processor,
                  label=f"load_release_model({folder.name})")


# ------------------------------------------------------------------------------------------ systemone
def invoice_request(tokenizer, code, target_tokens: int) -> tuple[dict, int]:
    """The model card's invoice request with a `notes` field grown until the prompt is ~target tokens."""
    from canaries.suites import default_decision_suite

    base = next(r for r in default_decision_suite() if "invoice" in r.get("id", ""))
    request = {k: v for k, v in base.items() if k in ("model", "state", "questions")}
    request = json.loads(json.dumps(request))
    line = "Line item: consulting services rendered under the framework agreement, billed monthly. "
    words = 0
    while True:
        request["state"]["invoice"]["notes"] = line * words
        length = len(code.encode_record(tokenizer, request).input_ids)
        if length >= target_tokens or words > 10000:
            return request, length
        words = max(words + 1, int(words * target_tokens / max(length, 1)) if words else 8)


def _max_abs_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for qid, want in a["answers"].items():
        got = b["answers"][qid]
        for key in ("noul", "score", "confidence"):
            if key in want:
                worst = max(worst, abs(want[key] - got[key]))
        for option, p in want.get("probabilities", {}).items():
            worst = max(worst, abs(p - got["probabilities"][option]))
        if want.get("choice") != got.get("choice"):
            worst = max(worst, 1.0)
    return worst


def section_systemone(args, loaded: Loaded) -> None:
    from clef_model.fast import FastSystemOne

    out: dict[str, Any] = {"model": loaded.label, "kernels": kernel_report(loaded.backbone)}
    request, tokens = invoice_request(loaded.tokenizer, loaded.code, args.s1_tokens)
    out["input_tokens"] = tokens
    say(f"systemone: invoice request padded to {tokens} tokens; kernels {out['kernels']}")
    plain_ref = loaded.reference

    def ref(r):
        with fast_setting("0"):  # the reference path, also when it is Runtime.systemone (hooks declined)
            return plain_ref(r)

    for _ in range(args.s1_warmup):
        ref(request)
    stock = [timed(lambda: ref(request))[1] for _ in range(args.s1_repeats)]
    out["stock"] = summary_ms(stock)
    say(f"systemone stock: {out['stock']}")
    if loaded.runtime is not None and DEVICE == "cuda":  # the product path: Runtime.systemone with its hooks
        try:
            with fast_setting(None):
                for _ in range(args.s1_warmup):
                    plain_ref(request)
                hooked = [timed(lambda: plain_ref(request))[1] for _ in range(args.s1_repeats)]
                out["runtime_fast"] = summary_ms(hooked)
                out["runtime_fast_agreement"] = _max_abs_diff(ref(request), plain_ref(request))
                out["runtime_fast_failed"] = loaded.runtime.__dict__.get("_fast_failed")
            say(f"systemone Runtime.systemone (fast hooks): {out['runtime_fast']}")
        except Exception as error:  # noqa: BLE001
            out["runtime_fast_error"] = f"{type(error).__name__}: {error}"
            say(f"Runtime fast hook FAILED: {traceback.format_exc()}")
    # split of the stock path: encode on the CPU, backbone forward, head
    code, tok = loaded.code, loaded.tokenizer
    encode = [timed(lambda: code.encode_record(tok, request))[1] for _ in range(10)]
    enc = code.encode_record(tok, request)
    batch = code.collate_records([enc], tok.pad_token_id or 0, torch.device(DEVICE))
    text = _text_model(loaded)
    with torch.inference_mode():
        fwd = [timed(lambda: text(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False))[1] for _ in range(10)]
    out["stock_split"] = {"encode": summary_ms(encode), "backbone": summary_ms(fwd)}

    fast = FastSystemOne(loaded.backbone, loaded.head, tok, code, ref)
    out["fast_uses_fla"] = fast.engine.uses_fla
    try:
        _, capture = timed(lambda: fast.backbone.warm([tokens]))
        out["graph_capture_s"] = round(capture, 2)
        for _ in range(args.s1_warmup):
            fast(request)
        fast_times = [timed(lambda: fast(request))[1] for _ in range(args.s1_repeats)]
        out["fast"] = summary_ms(fast_times)
        with torch.inference_mode():
            reps = min(20, args.s1_repeats)
            replay = [timed(lambda: fast.backbone(batch["input_ids"]))[1] for _ in range(reps)]
            eager = [timed(lambda: fast.engine.hidden_states(batch["input_ids"]))[1] for _ in range(reps)]
            hidden = fast.backbone(batch["input_ids"])
            head = [timed(lambda: loaded.head(hidden, batch["input_ids"], batch["attention_mask"], batch["records"],
                                              fast.engine.lm_head.weight))[1] for _ in range(reps)]
            from clef_model.fast import head_logits, head_plan

            vhead = [timed(lambda: head_logits(loaded.head, hidden[0], head_plan(enc, fast.engine.device),
                                               fast.engine.lm_head.weight))[1] for _ in range(reps)]
        out["fast_split"] = {"backbone_graph": summary_ms(replay), "backbone_engine_eager": summary_ms(eager),
                             "head_release": summary_ms(head), "head_vectorised": summary_ms(vhead),
                             "bucket": fast.backbone.bucket_for(tokens), "vector_head": fast.vector_head}
        if not args.s1_no_variants:
            out["engine_variants"] = engine_variants(loaded, batch["input_ids"], tokens, min(20, args.s1_repeats))
        diffs = [_max_abs_diff(ref(r), fast(r)) for r in _agreement_requests(loaded, request)[: args.s1_agree]]
        out["agreement_max_abs_diff"] = max(diffs)
        out["agreement_requests"] = len(diffs)
        say(f"systemone fast: {out['fast']} split {out['fast_split']} max|dp| {out['agreement_max_abs_diff']}")
        if args.s1_control:
            out["control_sdpa_math"] = control_sdpa_math(args, loaded, request, batch, ref)
        if args.s1_compile:
            RESULTS["systemone"] = out  # keep what was measured if the experiment below is cut short
            write_outputs(args.out)
            out["compiled"] = compiled_systemone(args, loaded, request, tokens, batch, ref)
    except Exception as error:  # noqa: BLE001 - record and go on with the other figures
        out["fast_error"] = f"{type(error).__name__}: {error}"
        say(f"systemone fast FAILED: {traceback.format_exc()}")
    RESULTS["systemone"] = out
    del fast
    free_gpu()


def _text_model(loaded: Loaded) -> torch.nn.Module:
    """The backbone's text decoder (transformers' forward, the reference for hidden states)."""
    model = loaded.backbone.model
    return model.language_model if hasattr(model, "language_model") else model


def _agreement(args, loaded: Loaded, request: dict, ref, other) -> dict[str, Any]:
    """Max |Δ| between two SystemOne paths over the agreement requests, and how many exceed 1e-3."""
    diffs = [_max_abs_diff(ref(r), other(r)) for r in _agreement_requests(loaded, request)[: args.s1_agree]]
    return {"agreement_max_abs_diff": max(diffs), "requests_over_1e-3": sum(d > 1e-3 for d in diffs),
            "agreement_requests": len(diffs)}


def control_sdpa_math(args, loaded: Loaded, request: dict, batch: dict, ref) -> dict[str, Any]:
    """Control: the stock reference path itself, with full attention forced to SDPA's math kernel.

    Both are legitimate transformers forwards that differ only in rounding. How far their answers and hidden
    states move apart shows how much this model amplifies rounding differences: the floor for any
    comparison of a faster path against the reference on it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def math_ref(r):
        with sdpa_kernel([SDPBackend.MATH]):
            return ref(r)

    result: dict[str, Any] = {}
    try:
        text = _text_model(loaded)
        with torch.inference_mode():
            reference = text(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.float()
            with sdpa_kernel([SDPBackend.MATH]):
                other = text(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.float()
        result["rel_error_vs_default_sdpa"] = round(float((other - reference).norm() / reference.norm()), 5)
        result.update(_agreement(args, loaded, request, ref, math_ref))
    except Exception as error:  # noqa: BLE001 - a control: record and go on
        result["error"] = f"{type(error).__name__}: {error}"
        say(f"control FAILED: {traceback.format_exc()}")
    say(f"systemone control (stock, SDPA math vs default): {result}")
    return result


def compiled_systemone(args, loaded: Loaded, request: dict, tokens: int, batch: dict, ref) -> dict[str, Any]:
    """Experiment: the SystemOne path with the engine's forward compiled by torch.compile (inductor), inside
    the same per-bucket CUDA graph. Inductor fuses the elementwise chains between the matmuls; its
    reductions and casts are not transformers' order of operations, so the answers are compared too."""
    import torch._inductor.config as inductor_config

    from clef_model.fast import FastSystemOne

    result: dict[str, Any] = {}
    if hasattr(inductor_config, "emulate_precision_casts"):
        inductor_config.emulate_precision_casts = True  # round intermediates to bf16 where eager does
        result["emulate_precision_casts"] = True
    fast = FastSystemOne(loaded.backbone, loaded.head, loaded.tokenizer, loaded.code, ref)
    fast.engine._run = torch.compile(fast.engine._run, dynamic=False)
    try:
        _, compile_s = timed(lambda: fast.backbone.warm([tokens]))
        result["compile_and_capture_s"] = round(compile_s, 1)
        say(f"compiled engine: compile + capture {compile_s:.1f}s")
        for _ in range(args.s1_warmup):
            fast(request)
        result["request"] = summary_ms([timed(lambda: fast(request))[1] for _ in range(args.s1_repeats)])
        with torch.inference_mode():
            replay = [timed(lambda: fast.backbone(batch["input_ids"]))[1] for _ in range(20)]
            reference = _text_model(loaded)(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.float()
            error = float((fast.backbone(batch["input_ids"]).float() - reference).norm() / reference.norm())
        result["backbone_graph"] = summary_ms(replay)
        result["rel_error_vs_transformers"] = round(error, 5)
        result.update(_agreement(args, loaded, request, ref, fast))
    except Exception as error:  # noqa: BLE001 - an experiment: record and go on
        result["error"] = f"{type(error).__name__}: {error}"
        say(f"compiled engine FAILED: {traceback.format_exc()}")
    say(f"systemone compiled: {result}")
    del fast
    free_gpu()
    return result


ENGINE_VARIANTS = {
    "conv1d+module_norms": dict(fused_norms=False, conv="conv1d"),
    "conv1d+fused_norms": dict(fused_norms=True, conv="conv1d"),
    "shift+fused_norms": dict(fused_norms=True, conv="shift"),
    "shift+module_norms": dict(fused_norms=False, conv="shift"),
}


@torch.inference_mode()
def engine_variants(loaded: Loaded, input_ids: torch.Tensor, tokens: int, repeats: int = 20) -> dict[str, Any]:
    """Graph-replay time of the SystemOne backbone for each engine option, and its error vs transformers."""
    from clef_model.fast import GraphedBackbone, QwenEngine

    text = _text_model(loaded)
    reference = text(input_ids=input_ids, use_cache=False).last_hidden_state.float()
    results = {}
    for name, options in ENGINE_VARIANTS.items():
        try:
            graphed = GraphedBackbone(QwenEngine(loaded.backbone, **options))
            graphed.warm([tokens])
            for _ in range(3):
                graphed(input_ids)
            times = [timed(lambda: graphed(input_ids))[1] for _ in range(repeats)]
            error = float((graphed(input_ids).float() - reference).norm() / reference.norm())
            results[name] = {**summary_ms(times), "rel_error_vs_transformers": round(error, 5)}
            del graphed
        except Exception as error:  # noqa: BLE001
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        say(f"engine variant {name}: {results[name]}")
        free_gpu()
    return results


def _agreement_requests(loaded: Loaded, padded: dict) -> list[dict]:
    from canaries.suites import default_decision_suite

    plain = [{k: v for k, v in r.items() if k in ("model", "state", "questions")} for r in default_decision_suite()]
    return [padded] + plain


# ------------------------------------------------------------------------------------------- generate
GEN_PROMPTS = [
    "What is the speed of light?", "Explain how a refrigerator works.", "Write a haiku about autumn.",
    "Why is the sky blue?", "List three uses of copper.", "Summarise the plot of Hamlet.",
    "How do vaccines work?", "What causes tides?",
]


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        enable_thinking=False, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _stock_generate(backbone, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    pad = tokenizer.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as Runtime.generate does
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    with torch.inference_mode():
        out = backbone.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=pad)
    return out[:, longest:].tolist()


@torch.inference_mode()
def teacher_forced(loaded: Loaded, sequence: list[int]) -> dict[str, Any]:
    """Next-token argmax of the reference forward vs the fast engine on one fixed sequence.

    Separates arithmetic differences (bf16 kernels) from logic errors: where the two disagree, the
    reference's own top-1/top-2 logit gap shows whether it was a near tie.
    """
    from clef_model.fast import QwenEngine

    ids = torch.tensor([sequence], device=DEVICE)
    text = _text_model(loaded)
    head = loaded.backbone.get_output_embeddings()
    ref = head(text(input_ids=ids, use_cache=False).last_hidden_state)[0].float()
    ours = head(QwenEngine(loaded.backbone).hidden_states(ids))[0].float()
    agree = (ref.argmax(-1) == ours.argmax(-1))
    top2 = ref.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])[~agree]
    return {"positions": len(sequence), "argmax_agreement": round(float(agree.float().mean()), 4),
            "disagreement_ref_top2_gaps": [round(float(g), 4) for g in gaps[:8]],
            "median_ref_top2_gap": round(float((top2[:, 0] - top2[:, 1]).median()), 4),
            "logit_rel_error": round(float((ours - ref).norm() / ref.norm()), 5)}


def section_profile(args, loaded: Loaded) -> None:
    """Where the GPU time goes: top kernels of one fast-engine SystemOne forward and one decode step."""
    from torch.profiler import ProfilerActivity, profile

    from clef_model.fast import QwenEngine, StaticGreedyDecoder

    engine = QwenEngine(loaded.backbone)
    out: dict[str, Any] = {}
    length = args.profile_tokens
    ids = torch.randint(100, 1000, (1, length), device=DEVICE)
    decoder = StaticGreedyDecoder(loaded.backbone, max_len=256, engine=engine, use_graphs=False)
    decoder.generate([[5] * 16], 2)
    state = decoder._state(1)
    jobs = {"systemone_forward": lambda: engine.hidden_states(ids), "decode_step": lambda: decoder._step_inplace(state)}
    for name, job in jobs.items():
        with torch.inference_mode():  # the decode step updates inference-mode caches in place
            for _ in range(2):
                job()
            sync()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                job()
                sync()
        def gpu_us(e) -> float:
            return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0)

        events = [e for e in prof.key_averages() if gpu_us(e) > 0 and "CUDA" in str(getattr(e, "device_type", ""))]
        total = sum(gpu_us(e) for e in events)
        top = sorted(events, key=lambda e: -gpu_us(e))[:14]
        out[name] = {"gpu_ms": round(total / 1000, 2), "kernels": sum(e.count for e in events),
                     "top": [(e.key[:70], round(gpu_us(e) / 1000, 3), e.count) for e in top]}
        say(f"profile {name}: {out[name]['gpu_ms']} ms GPU over {out[name]['kernels']} kernels")
        for row in out[name]["top"]:
            say(f"    {row}")
    RESULTS["profile"] = out
    free_gpu()


def decode_variants(loaded: Loaded, prompt: list[int], n: int, stock: list[int] | None) -> dict[str, Any]:
    """Batch-1 decode step time (CUDA graph) for each engine option; agreement with the stock tokens."""
    from clef_model.fast import QwenEngine, StaticGreedyDecoder

    variants = {"torch_recurrence+module_norms": dict(fused_norms=False, fla_decode=False),
                "torch_recurrence+fused_norms": dict(fused_norms=True, fla_decode=False),
                "fla_recurrence+module_norms": dict(fused_norms=False, fla_decode=True),
                "fla_recurrence+fused_norms": dict(fused_norms=True, fla_decode=True)}
    results = {}
    for name, options in variants.items():
        try:
            decoder = StaticGreedyDecoder(loaded.backbone, max_len=len(prompt) + n + 64,
                                          engine=QwenEngine(loaded.backbone, **options))
            decoder.generate([prompt], n)
            full = min(timed(lambda: decoder.generate([prompt], n))[1] for _ in range(3))
            pre = min(timed(lambda: decoder.generate([prompt], 1))[1] for _ in range(3))
            tokens = decoder.generate([prompt], n)[0]
            entry = {"decode_ms_per_step": round((full - pre) / (n - 1) * 1000, 3),
                     "tokens_per_s": round(n / full, 1)}
            if stock is not None:
                entry["first_divergence_from_stock"] = next(
                    (i for i, (x, y) in enumerate(zip(stock, tokens)) if x != y), len(stock))
            results[name] = entry
            del decoder
        except Exception as error:  # noqa: BLE001
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        say(f"decode variant {name}: {results[name]}")
        free_gpu()
    return results


def section_generate(args, loaded: Loaded) -> None:
    from clef_model.fast import StaticGreedyDecoder

    n = args.gen_tokens
    tok = loaded.tokenizer
    prompts = [_chat_ids(tok, p) for p in GEN_PROMPTS]
    out: dict[str, Any] = {"model": loaded.label, "new_tokens": n, "prompt_tokens": [len(p) for p in prompts]}
    stock: dict[str, Any] = {}
    stock_rows: dict[int, list[list[int]]] = {}
    _stock_generate(loaded.backbone, tok, prompts[:1], 4)  # warm-up
    for batch in [1] + args.gen_batches:
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        reps = 2 if batch == 1 else 1
        times = []
        for _ in range(reps):
            result, dt = timed(lambda: _stock_generate(loaded.backbone, tok, rows, n))
            times.append(dt)
        stock_rows[batch] = result
        stock[str(batch)] = {"seconds": round(min(times), 3), "tokens_per_s": round(batch * n / min(times), 1)}
        say(f"generate stock batch {batch}: {stock[str(batch)]}")
        if batch >= args.stock_batch_limit:
            break
    out["stock"] = stock
    if 1 in stock_rows and len(stock_rows) > 1:
        other = stock_rows[max(stock_rows)][0]
        mine = stock_rows[1][0]
        out["stock_batch1_vs_batched_first_divergence"] = next(
            (i for i, (x, y) in enumerate(zip(mine, other)) if x != y), len(mine))
    try:
        out["teacher_forced"] = teacher_forced(loaded, prompts[0] + stock_rows[1][0])
        say(f"teacher-forced agreement: {out['teacher_forced']}")
    except Exception as error:  # noqa: BLE001
        out["teacher_forced_error"] = f"{type(error).__name__}: {error}"
    fast: dict[str, Any] = {}
    try:
        decoder = StaticGreedyDecoder(loaded.backbone, max_len=max(len(p) for p in prompts) + n + 64)
        out["fast_uses_fla"] = decoder.engine.uses_fla
        for batch in [1] + args.gen_batches + args.fast_extra_batches:
            rows = [prompts[i % len(prompts)] for i in range(batch)]
            _, first = timed(lambda: decoder.generate(rows, n))  # includes graph capture for this batch size
            times, result = [], None
            for _ in range(3):
                result, dt = timed(lambda: decoder.generate(rows, n))
                times.append(dt)
            # decode-only rate: same call with 1 new token measures prefill + overhead
            _, pre = timed(lambda: decoder.generate(rows, 1))
            best = min(times)
            entry = {"seconds": round(best, 3), "tokens_per_s": round(batch * n / best, 1),
                     "first_call_s": round(first, 2), "prefill_s": round(pre, 4),
                     "decode_ms_per_step": round((best - pre) / max(n - 1, 1) * 1000, 3)}
            if batch in stock_rows:
                ref = stock_rows[batch]
                same = sum(a == b for a, b in zip(ref, result))
                prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, result)]
                entry["identical_rows"] = f"{same}/{len(ref)}"
                entry["first_divergence_min"] = min(prefix)
            fast[str(batch)] = entry
            say(f"generate fast batch {batch}: {entry}")
    except Exception as error:  # noqa: BLE001
        out["fast_error"] = f"{type(error).__name__}: {error}"
        say(f"generate fast FAILED: {traceback.format_exc()}")
    out["fast"] = fast
    if loaded.runtime is not None:  # the product path: Runtime.generate (chat template, stops), hooks on vs off
        try:
            rt = loaded.runtime
            product = {}
            for label, setting in (("stock", "0"), ("fast", None)):
                with fast_setting(setting):
                    rt.generate(GEN_PROMPTS[:2], max_new_tokens=8, batch_size=8)  # warm-up / graph capture
                    gens, dt = timed(lambda: rt.generate(GEN_PROMPTS, max_new_tokens=n, batch_size=8))
                made = sum(g.new_tokens for g in gens)
                product[label] = {"seconds": round(dt, 3), "new_tokens": made, "tokens_per_s": round(made / dt, 1),
                                  "token_ids": [g.token_ids for g in gens]}
            same = sum(a == b for a, b in zip(product["stock"].pop("token_ids"), product["fast"].pop("token_ids")))
            product["identical_answers"] = f"{same}/{len(GEN_PROMPTS)}"
            product["fast_failed"] = rt.__dict__.get("_fast_failed")
            out["runtime_generate_batch8"] = product
            say(f"Runtime.generate batch 8: {product}")
        except Exception as error:  # noqa: BLE001
            out["runtime_generate_error"] = f"{type(error).__name__}: {error}"
            say(f"Runtime.generate FAILED: {traceback.format_exc()}")
    out["decode_variants"] = decode_variants(loaded, prompts[0], n, stock_rows.get(1, [None])[0])
    RESULTS["generate"] = out
    free_gpu()


# ----------------------------------------------------------------------------------------- edit/canary
@contextlib.contextmanager
def stage_timers(names: dict[str, str], sink: dict[str, float]):
    """Wrap functions (``"module:attr" -> label``) wherever they are bound in loaded modules; sum seconds."""
    import importlib

    patched: list[tuple[Any, str, Any]] = []
    for target, label in names.items():
        mod_name, attr = target.split(":")
        try:
            original = getattr(importlib.import_module(mod_name), attr)
        except Exception:  # noqa: BLE001
            continue

        def wrapper(*a, __orig=original, __label=label, **k):
            sync()
            start = time.perf_counter()
            try:
                return __orig(*a, **k)
            finally:
                sync()
                sink[__label] = sink.get(__label, 0.0) + time.perf_counter() - start

        for module in list(sys.modules.values()):
            for key, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, key, wrapper)
                    patched.append((module, key, original))
    try:
        yield
    finally:
        for module, key, original in patched:
            setattr(module, key, original)


def _count_tokens(sink: dict[str, float]):
    """Count the tokens the statistics pass runs (attention-mask sums in surgery.statistics._forward)."""
    import surgery.statistics as st

    original = getattr(st, "_forward", None)
    if original is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def patch():
        def counting(model, ids, mask, *a, **k):
            sink["statistics_tokens"] = sink.get("statistics_tokens", 0) + int(mask.sum())
            sync()
            start = time.perf_counter()
            try:
                return original(model, ids, mask, *a, **k)
            finally:
                sync()  # per-forward shape and seconds: shows compile/autotune cost per new shape
                FORWARDS.append((tuple(ids.shape), round(time.perf_counter() - start, 3)))

        st._forward = counting
        try:
            yield
        finally:
            st._forward = original

    return patch()


def run_cli(argv: list[str]) -> tuple[int, float]:
    """Run ``blaze ARGV`` in-process; (exit code, seconds)."""
    from variants.cli import main

    start = time.perf_counter()
    code = 0
    try:
        main.main(args=argv, prog_name="blaze", standalone_mode=False)
    except SystemExit as error:
        code = int(error.code or 0)
    except Exception:  # noqa: BLE001
        say(traceback.format_exc())
        code = 1
    sync()
    return code, time.perf_counter() - start


def warm_fla() -> None:
    """Compile flash-linear-attention's gated-delta-rule kernels for the 9B head shapes (bf16)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001
        return
    for t in (300, 1):
        q = torch.randn(2, t, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn(2, t, 32, 128, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(2, t, 32, device="cuda")
        beta = torch.rand(2, t, 32, device="cuda", dtype=torch.bfloat16)
        fn = chunk_gated_delta_rule if t > 1 else fused_recurrent_gated_delta_rule
        with torch.inference_mode():
            fn(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


FORWARDS: list[tuple[tuple[int, ...], float]] = []

# A random-weight fixture has no behaviour, so the real gate rejects every strength and `--strength auto`
# would stop with "no strength passed". For timing the default recipe end to end, --relaxed-gate runs it
# with a copy of the spec whose gate accepts anything: every grid point is then tried (the worst case).
RELAXED_GATE = {"effect": "none", "min_effect": 0.0, "max_first_token_kl": 1e9, "max_mean_token_kl": 1e9, "max_loop_rate": 1.0,
                "max_limit_rate": 1.0, "max_empty_rate": 1.0, "max_decision_drift": 1e9, "max_argmax_flips": 1000000,
                "min_quality_ratio": 0.0}


def relaxed_spec(workdir: Path, behavior: str = "verbosity", grid: str | None = None) -> Path:
    """A copy of a shipped spec with RELAXED_GATE, written to WORKDIR/relaxed/BEHAVIOR.json."""
    from variants.spec import load_behavior

    data = json.loads(Path(load_behavior(behavior).source).read_text())
    data["gate"] = {**data.get("gate", {}), **RELAXED_GATE}
    if grid:
        data["defaults"] = {**data.get("defaults", {}), "strength_grid": [float(x) for x in grid.split(",")]}
    target = workdir / "relaxed" / f"{behavior}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1))
    return target


def prehash(folder: Path) -> None:
    """SHA-256 of every file of ``folder`` through blaze's hash cache (8 threads; hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from clef_model.filehash import file_sha256

    time.sleep(2.1)  # the hash cache trusts only files whose mtime is > 2 s older than the hash
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(file_sha256, files))


def section_edit(args) -> None:
    from clef_model.fixtures import build_fixture

    out: dict[str, Any] = {"num_layers": args.num_layers or 32}
    base = Path(args.workdir) / "base9b"
    if not (base / "model.safetensors.index.json").exists():
        _, dt = timed(lambda: build_fixture(base, args.preset, num_layers=args.num_layers, force=True,
                                            progress=False))
        out["fixture_build_s"] = round(dt, 1)
        say(f"fixture {args.preset} ({out['num_layers']} layers) built in {dt:.0f}s")
    out["fixture_gb"] = round(sum(p.stat().st_size for p in base.glob("*.safetensors")) / 1e9, 2)
    if not args.edit_repeat:
        # A base downloaded from the Hub has known SHA-256s (blob names); a freshly built fixture does not.
        # Hash it once, as blaze would on its first use of a local folder, and time that apart from the edit.
        out["base_hash_s"] = round(timed(lambda: prehash(base))[1], 1)
        say(f"base hashed once in {out['base_hash_s']}s (recorded in the hash cache)")
    else:
        # the same edit again in the same process: JIT caches warm, statistics recomputed
        shutil.rmtree(Path(os.environ.get("BLAZE_CACHE", Path.home() / ".cache" / "blaze")) / "statistics",
                      ignore_errors=True)
    if DEVICE == "cuda" and not args.skip_jit_warm:  # fla's Triton kernels compile on first use: time that once
        out["triton_jit_warm_s"] = round(timed(warm_fla)[1], 1)
        say(f"fla JIT warm-up {out['triton_jit_warm_s']}s")
    variant = Path(args.workdir) / "variant"
    behavior = str(relaxed_spec(Path(args.workdir), grid=args.grid)) if args.relaxed_gate else "verbosity"
    out["gate"] = "relaxed (every grid point passes; timing only)" if args.relaxed_gate else "the spec's"
    FORWARDS.clear()
    argv = ["edit", "--behavior", behavior, "--base", str(base), "--out", str(variant), "--force"] + args.edit_args
    stages: dict[str, float] = {}
    timers = {"clef_model.runtime:Runtime.load": "load", "surgery.edit:collect_statistics": "statistics",
              "surgery.edit:solve": "solve", "surgery.write:write_variant": "write",
              "canaries.run:run_canary": "canary_in_edit"}
    timers = {k: v for k, v in timers.items() if "." not in k.split(":")[1]}
    profiler = None
    if args.profile_edit:  # cProfile of the whole edit: where the wall time goes, by Python function
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        with stage_timers(timers, stages), _count_tokens(stages), _timed_runtime_load(stages):
            code, total = run_cli(argv)
    finally:  # also when interrupted (timeout -s INT): keep the profile and the forwards seen so far
        out["statistics_forwards"] = [[list(shape), sec] for shape, sec in FORWARDS]
        RESULTS["edit"] = out
        if profiler is not None:
            import io
            import pstats

            profiler.disable()
            args.out.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(str(args.out / "edit.prof"))
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(100)
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(50)
            (args.out / "edit_profile.txt").write_text(text.getvalue())
    out.update(command="blaze " + " ".join(argv), exit_code=code, total_s=round(total, 1),
               stages_s={k: round(v, 2) for k, v in stages.items() if k != "statistics_tokens"})
    if stages.get("statistics_tokens") and stages.get("statistics"):
        out["statistics_tokens"] = stages["statistics_tokens"]
        out["statistics_tokens_per_s"] = round(stages["statistics_tokens"] / stages["statistics"], 1)
    RESULTS["edit"] = out
    say(f"edit: {out}")
    free_gpu()


@contextlib.contextmanager
def _timed_runtime_load(sink: dict[str, float]):
    try:
        from clef_model.runtime import Runtime
    except ImportError:
        yield
        return
    original = Runtime.load.__func__

    def load(cls, *a, **k):
        start = time.perf_counter()
        try:
            return original(cls, *a, **k)
        finally:
            sync()
            sink["load"] = sink.get("load", 0.0) + time.perf_counter() - start

    Runtime.load = classmethod(load)
    try:
        yield
    finally:
        Runtime.load = classmethod(original)


def section_canary(args) -> None:
    base = Path(args.workdir) / "base9b"
    variant = Path(args.workdir) / "variant"
    argv = ["canary", str(variant), "--against", str(base)] + args.canary_args
    runs = [("fast", None)] + ([("stock", "0")] if args.canary_stock else [])
    for label, setting in runs:
        stages: dict[str, float] = {}
        with fast_setting(setting), _timed_runtime_load(stages):
            code, total = run_cli(argv + ["--json", str(Path(args.workdir) / f"canary_{label}.json")])
        RESULTS[f"canary_{label}"] = {"command": "blaze " + " ".join(argv), "BLAZE_FAST": setting or "default",
                                      "exit_code": code, "total_s": round(total, 1),
                                      "stages_s": {k: round(v, 2) for k, v in stages.items()}}
        say(f"canary {label}: {RESULTS[f'canary_{label}']}")
        free_gpu()
    free_gpu()


# ------------------------------------------------------------------------------------------- reporting
def to_markdown() -> str:
    lines = ["# GPU benchmark results", ""]
    env = RESULTS.get("env", {})
    lines.append(f"Machine: {env.get('gpu', '?')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
                 f"fla {env.get('fla')}; {env.get('date_utc')}; ceilings {env.get('bf16_matmul_tflops')} TFLOP/s bf16, "
                 f"{env.get('copy_tb_s')} TB/s copy.")
    lines.append("")
    if "systemone" in RESULTS:
        s = RESULTS["systemone"]
        lines += [f"## SystemOne ({s.get('model')}, {s.get('input_tokens')} tokens)", "",
                  "| path | median ms | p95 ms | n |", "|---|---|---|---|"]
        for key in ("stock", "fast"):
            if key in s:
                lines.append(f"| {key} | {s[key]['median_ms']} | {s[key]['p95_ms']} | {s[key]['n']} |")
        lines += ["", f"split: stock {json.dumps(s.get('stock_split'))}; fast {json.dumps(s.get('fast_split'))}",
                  f"agreement max |Δp| {s.get('agreement_max_abs_diff')} over {s.get('agreement_requests')} requests; "
                  f"kernels {json.dumps(s.get('kernels'))}",
                  f"Runtime.systemone with the hooks: {json.dumps(s.get('runtime_fast'))}",
                  f"engine variants (backbone graph replay): {json.dumps(s.get('engine_variants'))}", ""]
    if "generate" in RESULTS:
        g = RESULTS["generate"]
        lines += [f"## generate ({g.get('model')}, {g.get('new_tokens')} new tokens, greedy, no early stop)", "",
                  "| path | batch | tokens/s | seconds | detail |", "|---|---|---|---|---|"]
        for key in ("stock", "fast"):
            for batch, e in g.get(key, {}).items():
                detail = {k: v for k, v in e.items() if k not in ("tokens_per_s", "seconds")}
                lines.append(f"| {key} | {batch} | {e['tokens_per_s']} | {e['seconds']} | {json.dumps(detail)} |")
        lines += ["", f"Runtime.generate (8 prompts, batch 8, stops on): {json.dumps(g.get('runtime_generate_batch8'))}",
                  f"decode variants (batch 1): {json.dumps(g.get('decode_variants'))}",
                  f"teacher-forced: {json.dumps(g.get('teacher_forced'))}; stock batch-1 vs batched first divergence: "
                  f"{g.get('stock_batch1_vs_batched_first_divergence')}", ""]
    for key in ("edit", "canary_fast", "canary_stock", "profile"):
        if key in RESULTS:
            lines += [f"## {key}", "", "```json", json.dumps(RESULTS[key], indent=1), "```", ""]
    return "\n".join(lines)


def write_outputs(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (out / "results.md").write_text(to_markdown())
    (out / "log.txt").write_text("\n".join(LOG) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/blaze-bench"))
    parser.add_argument("--sections", default="env,systemone,generate")
    parser.add_argument("--model", default="random9b", help="'random9b', 'edit-base' or a release folder")
    parser.add_argument("--num-layers", type=int, default=None, help="fixture layers for edit/canary (default 32)")
    parser.add_argument("--s1-tokens", type=int, default=1029)
    parser.add_argument("--s1-repeats", type=int, default=60)
    parser.add_argument("--s1-warmup", type=int, default=5)
    parser.add_argument("--s1-agree", type=int, default=100, help="requests checked for answer agreement")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--gen-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[16])
    parser.add_argument("--fast-extra-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[64])
    parser.add_argument("--stock-batch-limit", type=int, default=16)
    parser.add_argument("--edit-args", default="", help="extra blaze edit options, one string")
    parser.add_argument("--canary-args", default="", help="extra blaze canary options, one string")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="9b", help="fixture preset for edit/canary ('tiny' for a CPU smoke test)")
    parser.add_argument("--canary-stock", action="store_true", help="also time blaze canary with BLAZE_FAST=0")
    parser.add_argument("--profile-edit", action="store_true", help="cProfile the edit; OUT/edit_profile.txt")
    parser.add_argument("--skip-jit-warm", action="store_true",
                        help="do not compile fla's kernels before the edit (the edit then pays the JIT itself)")
    parser.add_argument("--edit-repeat", action="store_true",
                        help="edit section on an existing fixture: statistics cache cleared, JIT caches warm")
    parser.add_argument("--grid", default=None, help="with --relaxed-gate: strength grid, e.g. 0.1,0.2")
    parser.add_argument("--relaxed-gate", action="store_true",
                        help="edit with a copy of the verbosity spec whose gate passes anything (random weights)")
    parser.add_argument("--profile-tokens", type=int, default=1088)
    parser.add_argument("--s1-compile", action="store_true",
                        help="systemone: also try the engine compiled by torch.compile inside the CUDA graph")
    parser.add_argument("--s1-control", action="store_true",
                        help="systemone: compare the stock path with itself under SDPA's math kernel (rounding floor)")
    parser.add_argument("--s1-no-variants", action="store_true",
                        help="systemone: skip the per-engine-option replay table")
    args = parser.parse_args()
    args.edit_args, args.canary_args = shlex.split(args.edit_args), shlex.split(args.canary_args)
    global DEVICE
    DEVICE = args.device
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BLAZE_QUIET", "1")
    sections = [s for s in args.sections.split(",") if s]
    loaded = None
    try:
        for section in sections:
            say(f"=== {section}")
            try:
                if section == "env":
                    section_env(args)
                elif section in ("systemone", "generate", "profile"):
                    if loaded is None:
                        if args.model == "tiny":
                            loaded, dt = timed(lambda: load_release(_tiny_folder(args.workdir)))
                        elif args.model == "random9b":
                            loaded, dt = timed(lambda: load_random9b(args.workdir))
                        else:
                            folder = args.workdir / "base9b" if args.model == "edit-base" else Path(args.model)
                            loaded, dt = timed(lambda: load_release(folder))
                        RESULTS.setdefault("load_s", {})[loaded.label] = round(dt, 1)
                    {"systemone": section_systemone, "generate": section_generate,
                     "profile": section_profile}[section](args, loaded)
                elif section == "edit":
                    section_edit(args)
                elif section == "canary":
                    section_canary(args)
                else:
                    say(f"unknown section {section}")
            except Exception:  # noqa: BLE001 - one failed section must not lose the others' numbers
                RESULTS.setdefault("errors", {})[section] = traceback.format_exc()
                say(f"section {section} FAILED:\n{traceback.format_exc()}")
            write_outputs(args.out)
    finally:
        write_outputs(args.out)
    print(to_markdown())


if __name__ == "__main__":
    main()
