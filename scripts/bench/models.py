"""The models the SystemOne and generate sections time: a release folder, or random 9B shapes in GPU memory."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_model.files import INDEX_FILE, RELEASE_CODE
from scripts.bench.common import Bench, timed


@dataclass
class Loaded:
    """What the SystemOne/generate sections need: backbone, head, tokenizer, release code, reference fn."""

    backbone: Any  # a transformers model (Qwen3_5ForConditionalGeneration or a causal LM)
    head: Any  # the release's JointSchemaHead
    tokenizer: Any
    code: Any  # the release's joint_schema_model module
    reference: Callable[[dict], dict]  # the stock SystemOne answer for a request
    processor: Any = None
    runtime: Any = None  # the clef_model Runtime, when the model was loaded through it
    label: str = ""


def load_model(bench: Bench) -> Loaded:
    """Load ``--model`` once (``tiny``, ``random9b``, ``edit-base`` or a release folder); record the seconds."""
    options = bench.options
    if options.model == "tiny":
        loaded, dt = timed(lambda: load_release(bench, tiny_folder(options.workdir)))
    elif options.model == "random9b":
        loaded, dt = timed(lambda: load_random9b(bench))
    else:
        folder = base_folder(options) if options.model == "edit-base" else Path(options.model)
        if options.model == "edit-base" and not (folder / INDEX_FILE).exists():
            build_base(bench, folder)
        loaded, dt = timed(lambda: load_release(bench, folder))
    bench.results.load_s[loaded.label] = round(dt, 1)
    return loaded


def base_folder(options: Any) -> Path:
    """Where the edit/canary sections and ``--model edit-base`` keep the ``--preset`` fixture."""
    return options.workdir / f"base{options.preset}"


def variant_folder(options: Any) -> Path:
    """Where the edit section writes its variant and the canary section reads it (``--variant-dir``)."""
    return options.variant_dir or options.workdir / "variant"


def build_base(bench: Bench, folder: Path) -> float:
    """Build the ``--preset`` fixture (``--num-layers``) at ``folder``; log and return the seconds."""
    from clef_model.fixtures import build_fixture

    options = bench.options
    _, dt = timed(lambda: build_fixture(folder, options.preset, num_layers=options.num_layers, force=True,
                                        progress=False))
    bench.say(f"fixture {options.preset} ({options.num_layers or 'all'} layers) built at {folder} in {dt:.0f}s")
    bench.results.load_s[f"fixture {options.preset} build"] = round(dt, 1)
    return dt


def tiny_folder(workdir: Path) -> Path:
    """The ``tiny`` fixture under ``workdir`` (built on first use): its tokenizer and release code."""
    from clef_model.fixtures import build_fixture

    folder = workdir / "tiny"
    if not folder.exists():
        build_fixture(folder, "tiny", progress=False)
    return folder


def load_random9b(bench: Bench) -> Loaded:
    """A random-weight model with the real 9B text shapes, built directly in GPU memory (bf16).

    Scales follow the fixture builder's rules, so activations behave like the `9b` fixture's.
    """
    from transformers import (
        AutoTokenizer,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
    )

    from clef_model import fixtures
    from clef_model.trust import import_release_code_file

    tiny = tiny_folder(bench.options.workdir)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in fixtures.SPECIAL_TOKENS}
    config, head_config = fixtures._configs("9b", None, ids)  # type: ignore[arg-type]  # the builder's 9b shapes
    config["vision_config"].update(depth=1)  # the text path never runs the vision tower
    code = import_release_code_file(tiny / RELEASE_CODE)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(bench.device):
            backbone = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config)).eval()
    finally:
        torch.set_default_dtype(previous)
    live = len(tokenizer)
    with torch.no_grad():
        for name, param in backbone.named_parameters():
            kind, a, b = fixtures._init_rule(name, tuple(param.shape))
            if kind == "log_uniform":
                param.copy_(torch.empty(param.shape, device="cuda").uniform_(a, b).log_())
            elif b > 0:
                param.normal_(a, b)
            else:
                param.fill_(a)
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
        tokenizer: Any

    processor = _Processor()
    processor.tokenizer = tokenizer

    def reference(request: dict) -> dict:
        return code.systemone(clef, processor, request)

    runtime = _runtime_around(tiny, backbone, tokenizer, processor, clef, code)
    return Loaded(backbone, head, tokenizer, code, reference, processor=processor, runtime=runtime,
                  label="random9b (in memory)")


def _runtime_around(folder: Path, backbone: Any, tokenizer: Any, processor: Any, clef: Any, code: Any) -> Any:
    """A ``Runtime`` over an in-memory model (``folder`` only supplies the release's files: chat template)."""
    from clef_model.release import resolve_release
    from clef_model.runtime import Runtime

    device = next(backbone.parameters()).device
    return Runtime(resolve_release(str(folder)), backbone, tokenizer, processor, device, torch.bfloat16, clef, code)


def load_release(bench: Bench, folder: Path) -> Loaded:
    """A release folder through ``clef_model.runtime.Runtime`` (its ``systemone`` is the reference)."""
    from clef_model.runtime import Runtime

    runtime = Runtime.load(str(folder), device=bench.device)
    if runtime.clef is None:
        raise RuntimeError(f"{folder} is not a Clef release: the SystemOne and generate sections need one")
    return Loaded(runtime.model, runtime.clef.head, runtime.tokenizer, runtime.release_code, runtime.systemone,
                  processor=runtime.processor, runtime=runtime, label=f"Runtime.load({folder.name})")


def kernel_report(backbone: torch.nn.Module) -> dict[str, Any]:
    """Which Gated DeltaNet / conv implementation the transformers module resolved to (best effort)."""
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
