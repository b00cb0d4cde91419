"""The figures of one benchmark run: one typed field per section, written as JSON and Markdown.

Each section's figures are a JSON-able record (nested dicts of numbers and short strings) whose keys are
the names BENCHMARKS.md quotes; ``to_json`` keeps the key layout of the former ``scripts/bench_gpu.py``
(``canary_fast``, ``canary_stock``, ...), so older ``results.json`` files read the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Record = dict[str, Any]


@dataclass
class Results:
    """What a run measured; a section that did not run (or failed before recording) stays None/empty."""

    env: Record | None = None
    load_s: dict[str, float] = field(default_factory=dict)  # model label -> seconds to load it
    peak_gpu_gib: dict[str, float] = field(default_factory=dict)  # section -> torch.cuda.max_memory_allocated
    systemone: Record | None = None
    s1batch: Record | None = None
    decode_profile: Record | None = None
    generate: Record | None = None
    edit: Record | None = None
    canary: dict[str, Record] = field(default_factory=dict)  # "fast" / "stock" -> that canary run
    errors: dict[str, str] = field(default_factory=dict)  # section -> traceback

    def to_dict(self) -> Record:
        """The results as ``results.json`` holds them (sections that did not run are left out)."""
        data: Record = {}
        for key in ("env", "systemone", "s1batch", "generate", "decode_profile", "edit"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        if self.load_s:
            data["load_s"] = self.load_s
        if self.peak_gpu_gib:
            data["peak_gpu_gib"] = self.peak_gpu_gib
        for label, record in self.canary.items():
            data[f"canary_{label}"] = record
        if self.errors:
            data["errors"] = self.errors
        return data

    def to_json(self) -> str:
        """``results.json``."""
        return json.dumps(self.to_dict(), indent=1, default=str)

    def to_markdown(self) -> str:
        """``results.md``: the headline tables, then the other sections' records as JSON."""
        lines = ["# GPU benchmark results", ""]
        env = self.env or {}
        machine = (f"Machine: {env.get('gpu', '?')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
                   f"fla {env.get('fla')}; {env.get('date_utc')}; ceilings {env.get('bf16_matmul_tflops')} TFLOP/s "
                   f"bf16, {env.get('copy_tb_s')} TB/s copy.")
        lines += [machine, ""]
        if self.peak_gpu_gib:
            lines += [f"Peak GPU memory per section (GiB, torch.cuda.max_memory_allocated): {json.dumps(self.peak_gpu_gib)}", ""]
        if self.systemone is not None:
            lines += _systemone_markdown(self.systemone)
        if self.s1batch is not None:
            lines += _s1batch_markdown(self.s1batch)
        if self.generate is not None:
            lines += _generate_markdown(self.generate)
        others = {"decode_profile": self.decode_profile, "edit": self.edit, **{f"canary_{label}": record for label, record in self.canary.items()}}
        for key, record in others.items():
            if record is not None:
                lines += [f"## {key}", "", "```json", json.dumps(record, indent=1), "```", ""]
        return "\n".join(lines)


def _systemone_markdown(s: Record) -> list[str]:
    lines = [f"## SystemOne ({s.get('model')}, {s.get('input_tokens')} tokens)", "",
             "| path | median ms | p95 ms | n |", "|---|---|---|---|"]
    for key in ("stock", "runtime_fast", "fast"):
        if key in s:
            lines.append(f"| {key} | {s[key]['median_ms']} | {s[key]['p95_ms']} | {s[key]['n']} |")
    return lines + [
        "", f"split: stock {json.dumps(s.get('stock_split'))}; fast {json.dumps(s.get('fast_split'))}",
        (f"agreement max |Δp| {s.get('agreement_max_abs_diff')} over {s.get('agreement_requests')} requests; "
         f"kernels {json.dumps(s.get('kernels'))}"),
        f"control (stock path, SDPA math kernel): {json.dumps(s.get('control_sdpa_math'))}", ""]


def _s1batch_markdown(s: Record) -> list[str]:
    agreement = s.get("agreement", {})
    lines = [f"## SystemOne, mixed lengths ({s.get('model')}, {s.get('requests')} requests, mean {s.get('mean_tokens')} "
             f"tokens, budget {s.get('budget')}, overhead {s.get('overhead_tokens')})", "",
             "| path | req/s | max |Δp| vs stock | requests over own control |", "|---|---|---|---|"]
    for name, rate in s.get("req_per_s", {}).items():
        a = agreement.get(name, {})
        lines.append(f"| {name} | {rate} | {a.get('max', '—')} | {a.get('over_own_control', '—')} |")
    plans = {k: v for k, v in s.items() if k.startswith("plan_")}
    return lines + ["", f"control (stock, SDPA math vs default) max |Δp|: {agreement.get('control_max')}; "
                        f"plans (rows per batch): {json.dumps(plans)}; peak GPU GiB {s.get('peak_gpu_gib')}", ""]


def _generate_markdown(g: Record) -> list[str]:
    lines = [f"## generate ({g.get('model')}, {g.get('new_tokens')} new tokens, greedy, no early stop)", "",
             "| path | batch | tokens/s | seconds | detail |", "|---|---|---|---|---|"]
    for key in ("stock", "fast"):
        for batch, e in g.get(key, {}).items():
            detail = {k: v for k, v in e.items() if k not in ("tokens_per_s", "seconds")}
            lines.append(f"| {key} | {batch} | {e['tokens_per_s']} | {e['seconds']} | {json.dumps(detail)} |")
    return lines + [
        "", f"Runtime.generate (8 prompts, batch 8, stops on): {json.dumps(g.get('runtime_generate_batch8'))}",
        f"stock batch-1 vs batched first divergence: {g.get('stock_batch1_vs_batched_first_divergence')}", ""]
