"""Readable canary reports: a terminal summary (`print_report`) and Markdown (`to_markdown`, reused by the model card).

Both read only the report dict built by `canaries.run`, so a report loaded back from `--json` renders the same.
"""

from __future__ import annotations

from typing import Any

import click


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 10 ** -digits or value == 0 else f"{value:.2e}"
    return str(value)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:+.1f}%"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), str(prompt))


def _one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def example_prompt(report: dict[str, Any]) -> dict[str, Any] | None:
    """The free-form row shown as the vanilla-vs-variant example: the first prompt of the run."""
    rows = report["freeform"]["prompts"]
    return rows[0] if rows else None


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, base, variant, note) rows shared by the terminal table and the Markdown summary."""
    free = report["freeform"]["summary"]
    damage = report["damage"]["summary"]
    rows = [
        ("mean answer tokens", _fmt(free["mean_tokens"]["base"], 1), _fmt(free["mean_tokens"]["variant"], 1),
         _pct(free["mean_tokens"]["change"])),
        ("median answer tokens", _fmt(free["median_tokens"]["base"], 1), _fmt(free["median_tokens"]["variant"], 1),
         _pct(free["median_tokens"]["change"])),
        ("mean answer words", _fmt(free["mean_words"]["base"], 1), _fmt(free["mean_words"]["variant"], 1),
         _pct(free["mean_words"]["change"])),
        ("loops", _fmt(free["loop_rate"]["base"]), _fmt(free["loop_rate"]["variant"]),
         f"new {_fmt(free['loop_rate']['new'])}"),
        ("hit token limit", _fmt(free["hit_limit_rate"]["base"]), _fmt(free["hit_limit_rate"]["variant"]),
         f"new {_fmt(free['hit_limit_rate']['new'])}"),
        ("empty answers", _fmt(free["empty_rate"]["base"]), _fmt(free["empty_rate"]["variant"]),
         f"new {_fmt(free['empty_rate']['new'])}"),
    ]
    quality = free["quality"]
    if quality["items"]:
        rows.append((f"keyword hits ({quality['check']})", f"{quality['base_hits']}/{quality['items']}",
                     f"{quality['variant_hits']}/{quality['items']}", f"ratio {_fmt(quality['ratio'])}"))
    rows += [
        ("first-token KL (mean / max)", "", f"{_fmt(damage['first_token_kl']['mean'], 4)} / "
         f"{_fmt(damage['first_token_kl']['max'], 4)}", "neutral prompts"),
        ("per-token KL (mean)", "", _fmt(damage["mean_token_kl"], 4),
         f"{damage['scored_positions']} teacher-forced positions"),
        ("perplexity, neutral texts", _fmt(damage["perplexity"]["base"], 2), _fmt(damage["perplexity"]["variant"], 2),
         _pct(damage["perplexity"]["change"])),
    ]
    decisions = report["decisions"]
    if decisions.get("applicable"):
        s = decisions["summary"]
        rows.append(("decisions |Δp| (max / mean)", "", f"{_fmt(s['max_abs_delta'], 4)} / "
                     f"{_fmt(s['mean_abs_delta'], 4)}", f"{s['questions']} questions, {s['argmax_flips']} flips"))
        cal_b, cal_v = s["calibration"]["base"], s["calibration"]["variant"]
        if cal_b["labelled_questions"]:
            for key, name in (("accuracy", "accuracy (labelled)"), ("ece", "top-label ECE"), ("brier", "Brier")):
                rows.append((name, _fmt(cal_b[key]), _fmt(cal_v[key]), f"{cal_b['labelled_questions']} questions"))
    return rows


def _integrity_lines(integrity: dict[str, Any] | None) -> list[str]:
    if not integrity:
        return ["not checked (no release folders to compare)"]
    lines = [f"{'passed' if integrity['passed'] else 'FAILED'}: {integrity['identical_tensors']} of "
             f"{integrity['tensors']} tensors identical, {len(integrity['changed_tensors'])} changed"]
    for name, label in (("joint_head_sha256", "joint head"), ("release_code_sha256", "release code")):
        entry = integrity.get(name)
        if entry:
            lines.append(f"{label} sha256 {str(entry['variant'])[:16]}… "
                         f"{'= base' if entry['equal'] else '≠ base ' + str(entry['base'])[:16] + '…'}")
    for change in integrity["changed_tensors"]:
        lines.append(f"{change['name']}: ‖ΔW‖/‖W‖ {change['relative_change']:.2e}, rank {_fmt(change['rank'])}")
    lines += [f"problem: {p}" for p in integrity["problems"]]
    return lines


def print_report(report: dict[str, Any], echo=click.echo) -> None:
    """Print a readable summary: figures table, example answers, decision lines, integrity, gate."""
    labels = report.get("meta", {})
    base_label, variant_label = labels.get("base_label", "base"), labels.get("variant_label", "variant")
    rows = [("figure", base_label, variant_label, "change / note")] + summary_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    echo("")
    for index, row in enumerate(rows):
        echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if index == 0:
            echo("  ".join("-" * w for w in widths))
    example = example_prompt(report)
    if example:
        echo("")
        echo(f"Q: {_one_line(_prompt_text(example['prompt']), 100)}")
        echo(f"  {base_label}: {_one_line(example['base']['text'], 110)}")
        echo(f"  {variant_label}: {_one_line(example['variant']['text'], 110)}")
    decisions = report["decisions"]
    echo("")
    if decisions.get("applicable"):
        for request in decisions["requests"][:6]:
            echo(f"{request['id']}: " + "; ".join(request["lines"]))
        if len(decisions["requests"]) > 6:
            echo(f"… {len(decisions['requests']) - 6} more requests in the JSON report")
    else:
        echo(f"typed decisions: {decisions.get('reason', 'not run')}")
    echo("")
    echo("integrity: " + "\n  ".join(_integrity_lines(report.get("integrity"))))
    gate = report["gate"]
    echo("")
    for check in gate["checks"]:
        mark = "ok  " if check["passed"] else "FAIL"
        echo(f"[{mark}] {check['name']}: {_fmt(check['value'], 4)} {check['op']} {_fmt(check['threshold'], 4)}"
             f"  ({check['detail']})")
    echo(f"gate: {'PASSED' if gate['passed'] else 'FAILED (' + ', '.join(gate['failed']) + ')'}")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict[str, Any]) -> str:
    """The canary report as Markdown: summary table, the first free-form example, decision lines, integrity, gate."""
    meta = report.get("meta", {})
    base_label, variant_label = meta.get("base_label", "base"), meta.get("variant_label", "variant")
    out = ["## Canary report", ""]
    gate = report["gate"]
    out.append(f"**Gate: {'passed' if gate['passed'] else 'failed'}**"
               + ("" if gate["passed"] else f" ({', '.join(gate['failed'])})"))
    out += ["", f"| figure | {base_label} (vanilla) | {variant_label} | change / note |", "|---|---|---|---|"]
    out += [f"| {' | '.join(_md_cell(c) for c in row)} |" for row in summary_rows(report)]
    example = example_prompt(report)
    if example:
        out += ["", "### Free-form example", "", f"**Prompt:** {_md_cell(_prompt_text(example['prompt']))}", "",
                f"- vanilla ({example['base']['tokens']} tokens): {_md_cell(example['base']['text'].strip())}",
                f"- variant ({example['variant']['tokens']} tokens): {_md_cell(example['variant']['text'].strip())}"]
    decisions = report["decisions"]
    out += ["", "### Typed decisions", ""]
    if decisions.get("applicable"):
        for request in decisions["requests"]:
            out.append(f"- `{request['id']}`" + (" (image)" if request.get("image") else "") + ": "
                       + "; ".join(f"`{line}`" for line in request["lines"]))
    else:
        out.append(f"Typed-decision canaries: {decisions.get('reason', 'not run')}.")
    out += ["", "### Integrity", ""] + [f"- {line}" for line in _integrity_lines(report.get("integrity"))]
    out += ["", "### Gate", "", "| check | value | threshold | passed |", "|---|---|---|---|"]
    out += [f"| {c['name']} | {_fmt(c['value'], 4)} | {c['op']} {_fmt(c['threshold'], 4)} | "
            f"{'yes' if c['passed'] else '**no**'} |" for c in gate["checks"]]
    return "\n".join(out) + "\n"
