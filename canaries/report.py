"""Readable canary reports: a terminal summary (`print_report`) and Markdown (`to_markdown`, reused by the model card).

Both read only the report dict built by `canaries.run`, so a report loaded back from `--json` renders the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import click

from canaries import decision_eval


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
    markdown = free.get("markdown_rate")
    if markdown is not None:
        n = free["effect_prompts"]
        rows.append(("answers with markdown", f"{markdown['base_answers']}/{n}", f"{markdown['variant_answers']}/{n}",
                     f"cut {_pct(free['markdown_cut'])}"))
    for measure, entry in (free.get("stance") or {}).items():
        rows.append((STANCE_LABELS[measure], f"{entry['base']}/{entry['items']}",
                     f"{entry['variant']}/{entry['items']}", f"change {entry['change']:+d} items"))
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


STANCE_LABELS = {"hold": "pushback chats held (user wrong)", "accept": "corrections accepted (user right)"}


def _effect_value(value: float, unit: str) -> str:
    return _pct(value) if unit == "relative" else f"{value:+.0f} items"


def _fraction_row(label: str, counts: dict[str, Any], total: Any) -> tuple[str, str, str, str]:
    """`label` and `counts[side]/total` for the base, the variant and the prompted base."""
    return label, f"{counts['base']}/{total}", f"{counts['variant']}/{total}", f"{counts['prompted']}/{total}"


def prompted_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]] | None:
    """(figure, base, variant, prompted) rows of the prompted ceiling; None when it was not run."""
    ceiling = report["freeform"].get("prompted")
    if not ceiling:
        return None
    means, quality, markdown = ceiling["mean_tokens"], ceiling["quality"], ceiling["markdown"]
    rows = [("mean answer tokens", _fmt(means["base"], 1), _fmt(means["variant"], 1), _fmt(means["prompted"], 1))]
    if quality["items"]:
        hits = {side: quality[f"{side}_hits"] for side in ("base", "variant", "prompted")}
        rows.append(_fraction_row("keyword hits", hits, quality["items"]))
    rows.append(_fraction_row("answers with markdown", markdown, markdown["items"]))
    for measure, entry in ceiling["stance"].items():
        rows.append(_fraction_row(STANCE_LABELS[measure], entry, entry["items"]))
    return rows


def effect_rows(report: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(effect, variant, prompted, edit/prompted, margin) rows of the prompted ceiling ([] when not run)."""
    ceiling = report["freeform"].get("prompted")
    out = []
    for effect in (ceiling or {}).get("effects", []):
        name = effect["name"] + (" (gated)" if effect["name"] == ceiling.get("gated_effect") else "")
        fraction = ("— (prompting within margin)" if not effect["reachable"]
                    else f"{effect['fraction'] * 100:.0f} %")
        margin = (f"{effect['margin'] * 100:.0f} %" if effect["unit"] == "relative"
                  else f"{effect['margin']:.0f} items")
        out.append((name, _effect_value(effect["variant"], effect["unit"]),
                    _effect_value(effect["prompted"], effect["unit"]), fraction, margin))
    return out


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


def noise_sentence(report: dict[str, Any]) -> str | None:
    """The free-form noise floor beside the edit's new loops (`canaries.noise`), or None when it was not run."""
    from canaries.noise import noise_line

    noise = report["freeform"].get("noise_floor")
    if not noise:
        return None
    rows = report["freeform"]["prompts"]
    return noise_line(noise, sum(bool(r["variant"]["loop"]) and not r["base"]["loop"] for r in rows))


def print_report(report: dict[str, Any], echo: Callable[[str], Any] = click.echo) -> None:
    """Print a readable summary: figures table, example answers, prompted ceiling, decision lines, integrity, gate."""
    labels = report.get("meta", {})
    base_label, variant_label = labels.get("base_label", "base"), labels.get("variant_label", "variant")
    echo("")
    _echo_table([("figure", base_label, variant_label, "change / note")] + summary_rows(report), echo)
    noise = noise_sentence(report)
    if noise:
        echo(noise)
    for warning in report.get("warnings") or []:
        echo(f"warning: {warning}")
    example = example_prompt(report)
    if example:
        echo("")
        echo(f"Q: {_one_line(_prompt_text(example['prompt']), 100)}")
        echo(f"  {base_label}: {_one_line(example['base']['text'], 110)}")
        echo(f"  {variant_label}: {_one_line(example['variant']['text'], 110)}")
    _echo_prompted(report, echo, base_label, variant_label)
    decisions = report["decisions"]
    echo("")
    if decisions.get("applicable"):
        for request in decisions["requests"][:6]:
            echo(f"{request['id']}: " + "; ".join(request["lines"]))
        if len(decisions["requests"]) > 6:
            echo(f"… {len(decisions['requests']) - 6} more requests in the JSON report")
        if decisions.get("eval"):
            echo(decision_eval.summary_line(decisions["eval"]) or "")
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


def _echo_table(rows: Sequence[Sequence[str]], echo: Callable[[str], Any]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if index == 0:
            echo("  ".join("-" * w for w in widths))


def _echo_prompted(report: dict[str, Any], echo: Callable[[str], Any], base_label: str, variant_label: str) -> None:
    rows = prompted_rows(report)
    echo("")
    if rows is None:
        echo("prompted ceiling: not run")
        return
    ceiling = report["freeform"]["prompted"]
    echo(f"prompted ceiling: the base asked with the wanted system prompt ({ceiling['items']} items): "
         f"{_one_line(ceiling['system'], 90)}")
    _echo_table([("figure", base_label, variant_label, "prompted base")] + rows, echo)
    echo("")
    _echo_table([("effect", variant_label, "prompted", "edit / prompted", "noise margin")] + effect_rows(report),
                echo)
    for note in ceiling["notes"]:
        echo(f"  {note}")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict[str, Any]) -> str:
    """The canary report as Markdown: summary table, the first free-form example, the prompted ceiling, decision
    lines, integrity, gate."""
    meta = report.get("meta", {})
    base_label, variant_label = meta.get("base_label", "base"), meta.get("variant_label", "variant")
    out = ["## Canary report", ""]
    gate = report["gate"]
    out.append(f"**Gate: {'passed' if gate['passed'] else 'failed'}**"
               + ("" if gate["passed"] else f" ({', '.join(gate['failed'])})"))
    out += ["", f"| figure | {base_label} (vanilla) | {variant_label} | change / note |", "|---|---|---|---|"]
    out += [f"| {' | '.join(_md_cell(c) for c in row)} |" for row in summary_rows(report)]
    noise = noise_sentence(report)
    if noise:
        out += ["", _md_cell(noise)]
    if report.get("warnings"):
        out += ["", "### Warnings", ""] + [f"- {_md_cell(w)}" for w in report["warnings"]]
    example = example_prompt(report)
    if example:
        out += ["", "### Free-form example", "", f"**Prompt:** {_md_cell(_prompt_text(example['prompt']))}", "",
                f"- vanilla ({example['base']['tokens']} tokens): {_md_cell(example['base']['text'].strip())}",
                f"- variant ({example['variant']['tokens']} tokens): {_md_cell(example['variant']['text'].strip())}"]
    out += _prompted_markdown(report, base_label, variant_label)
    decisions = report["decisions"]
    out += ["", "### Typed decisions", ""]
    if decisions.get("applicable"):
        for request in decisions["requests"]:
            out.append(f"- `{request['id']}`" + (" (image)" if request.get("image") else "") + ": "
                       + "; ".join(f"`{line}`" for line in request["lines"]))
    else:
        out.append(f"Typed-decision canaries: {decisions.get('reason', 'not run')}.")
    out += ["", *decision_eval.markdown(decisions.get("eval"), heading="###")] if decisions.get("eval") else []
    out += ["", "### Integrity", ""] + [f"- {line}" for line in _integrity_lines(report.get("integrity"))]
    out += ["", "### Gate", "", "| check | value | threshold | passed |", "|---|---|---|---|"]
    out += [f"| {c['name']} | {_fmt(c['value'], 4)} | {c['op']} {_fmt(c['threshold'], 4)} | "
            f"{'yes' if c['passed'] else '**no**'} |" for c in gate["checks"]]
    return "\n".join(out) + "\n"


def _prompted_markdown(report: dict[str, Any], base_label: str, variant_label: str) -> list[str]:
    rows = prompted_rows(report)
    out = ["", "### Prompted ceiling", ""]
    if rows is None:
        return out + ["Not run (the base was not asked with the behaviour's wanted system prompt)."]
    ceiling = report["freeform"]["prompted"]
    out += [(f"The base asked with the behaviour's wanted system prompt on the {ceiling['items']} effect items: "
             f"*{_md_cell(ceiling['system'])}*"), "",
            f"| figure | {base_label} (vanilla) | {variant_label} | prompted base |", "|---|---|---|---|"]
    out += [f"| {' | '.join(_md_cell(c) for c in row)} |" for row in rows]
    out += ["", f"| effect | {variant_label} | prompted | edit / prompted | noise margin |", "|---|---|---|---|---|"]
    out += [f"| {' | '.join(_md_cell(c) for c in row)} |" for row in effect_rows(report)]
    out += [""] + [f"- {_md_cell(note)}" for note in ceiling["notes"]]
    return out

