"""`blaze fixture --preset decisions`: a tiny Clef-format release whose typed decisions are *trained*.

Why: on random-weight releases every decision sits near a tie, so a canary cannot tell an edit's drift from
rounding noise. This release is the tiny fixture (`clef_model.fixtures`, preset `tiny`: the real layout,
Cloudflare's `joint_schema_model.py`, a Qwen3.5 backbone with `mtp.*`) fine-tuned on the synthetic
decision records of `clef_model.decision_data` with clef-finetune 0.1.0:

- model assembly is clef-finetune's `build_training_model` (LoRA on the text decoder's linear layers,
  found by `discover_lora_targets`, plus the joint head in float32 behind its `Fp32Head` boundary);
- the loss is clef-finetune's `question_loss` (Cloudflare's recipe: label-smoothed cross-entropy + Brier);
- the optimiser and schedule are clef-finetune's (AdamW, one learning rate for LoRA and one for the head,
  linear warm-up then cosine).

What differs from `clef_finetune.train.train`, and why:

- Its loop runs every record through the whole backbone, forward and backward (batch 1 + gradient
  accumulation). On this tiny backbone that costs ~0.35 s per record on a shared CPU core (its linear
  attention runs in pure torch), and batching does not help (8 records: 3.4 s). The head needs a few
  thousand record passes to become confident, far beyond the 3-minute budget. So training has two stages:
  (1) LoRA (decoder layers 4–7) and the head together, clef-finetune's full recipe, for a few batches; LoRA
  is then merged and rounded to the release's bf16; (2) the joint head alone on that backbone's last hidden
  states, computed once per record (the backbone is frozen in that stage, so they cannot change), through
  `_batched_head_logits` (the release head's function on a padded batch, ~3x faster than its per-record loop).
- Stage 2 adds Gaussian noise to the cached hidden states (`head_noise`, relative to each position's RMS) and
  uses no label smoothing. Why (measured, README "Typed decisions, measured"): without noise the head fits its
  400 training records to a loss of 1e-4 by leaning on incidental features of the random backbone's states,
  so an irrelevant change (another customer name, another ticket id) moved a held-out refund answer from
  p 1.0 to 0.17; training with noise is a smoothness regulariser (Bishop 1995, "Training with noise is
  equivalent to Tikhonov regularization"), and with it (800 records, 800 steps) no dev answer moved by more
  than 0.01 under a name and id swap (the recipe was chosen on the dev split, not on the eval records). Smoothing 0.05 would cap a three-option answer at p 0.967, where a small logit shift still
  moves p by a few hundredths; the fixture needs decided answers.
- Stage 2 also uses AdamW weight decay 0.05 (`BUILD_VERSION` 4). Why (measured, chosen on dev): this random
  backbone amplifies bf16 rounding (its residual branches are as large as the stream: the bf16-vs-float32
  difference of its last hidden states is 2.4 % at the median position and over 100 % at the worst), and
  without decay a few answers stalled at p 0.94-0.99, where that rounding moved them by 0.01-0.02: more than
  the 0.01 an edit is allowed. With decay every dev answer reaches p >= 0.999 and the bf16 noise floor on dev
  falls from 0.0085 to 0.0007. Heavy-tailed per-position noise and an exponential moving average of the
  head's weights were also tried on dev and dropped.
- The export is blaze's, not clef-finetune's `merge`: `merge` calls `save_pretrained`, which drops the
  release's `mtp.*` tensors and re-shards, while the fixture must keep the exact release layout. So the
  merged LoRA weights (W + s·B·A, computed by PEFT's `merge_and_unload`, stored in bf16 like the base) replace
  the base's tensors in place, and every other tensor is copied byte for byte.

The release is cached in `$BLAZE_CACHE/fixtures/` under a key of (seed, this code, the library versions);
`build_decision_fixture` copies the cached folder to OUT. OUT also gets `decision_eval.jsonl`: held-out
labelled records never used in training, three with an image (a data: URI, a relative PNG path); and
`decision_dev.jsonl`: the `dev` split (240 labelled text records, neither trained on nor evaluated), a
stand-in for a user's own decision traffic (`blaze edit --preserve-requests`), written at copy time.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clef_model.checkpoint import CheckpointReader, ShardedWriter, atomic_output
from clef_model.errors import BlazeError

EVAL_FILE = "decision_eval.jsonl"
DEV_FILE = "decision_dev.jsonl"
DEV_RECORDS = 240  # the dev split written beside the release: a stand-in for a user's own decision traffic
IMAGES_DIR = "decision_eval_images"
TRAIN_INFO_FILE = "blaze_decision_training.json"
BUILD_VERSION = 4  # part of the cache key: bump it when the training or export code changes


@dataclass(frozen=True)
class TrainSettings:
    """Training settings of the decision fixture (recorded in the release's `blaze_decision_training.json`)."""

    train_records: int = 800
    eval_records: int = 240
    head_steps: int = 800  # stage 2: the head alone, on the merged backbone's cached hidden states
    head_batch_size: int = 16
    head_stage_lr: float = 6e-3
    lora_steps: int = 4  # stage 1: LoRA + head
    batch_size: int = 8
    lr: float = 1e-3  # LoRA (clef-finetune's default 1e-4 is for a 9B model and 1,000 steps)
    head_lr: float = 5e-4
    warmup_steps: int = 8
    lora_r: int = 8
    lora_alpha: int = 16
    lora_first_layer: int = 4  # LoRA on decoder layers >= this one: the backward pass stops there
    label_smoothing: float = 0.05  # clef-finetune's default (the LoRA stage)
    # the head stage: none, so the head can saturate (smoothing 0.05 caps p at 0.967 for three options, where a
    # small logit shift still moves p by a few hundredths); the fixture needs decided, not calibrated, answers
    head_label_smoothing: float = 0.0
    # AdamW's decoupled weight decay in the head stage (BUILD_VERSION 4): without it one answer in a few dozen sat
    # at p 0.94-0.99 and moved by 0.01-0.02 between bf16 autocast and float32 (README "Typed decisions, measured")
    head_weight_decay: float = 0.05
    head_noise: float = 0.2  # Gaussian noise on the cached hidden states, relative to each position's RMS
    brier_weight: float = 1.0  # clef-finetune's default
    max_grad_norm: float = 1.0
    image_rate: float = 0.1  # share of training records that carry an (uninformative) image


def _quiet() -> bool:
    from clef_model.env import quiet

    return quiet()


def _log(message: str) -> None:
    if not _quiet():
        print(f"[fixture decisions] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------
# images: small PNGs drawn with pillow (no binary files in the repo)
# ---------------------------------------------------------------------------------------------------
def photo_png(index: int) -> bytes:
    """A small PNG "photo of a document" (coloured blocks and a caption); carries no decision information."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"photo:{index}")
    image = Image.new("RGB", (96, 64), tuple(rng.randrange(160, 256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = rng.randrange(0, 80), rng.randrange(0, 48)
        draw.rectangle((x, y, x + 16, y + 12), fill=tuple(rng.randrange(0, 256) for _ in range(3)))
    draw.text((4, 50), f"doc {index}", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def data_uri(png: bytes) -> str:
    """A `data:image/png;base64,…` URI for PNG bytes."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _pil(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


# ---------------------------------------------------------------------------------------------------
# training (clef-finetune's model assembly, loss and optimiser; batched)
# ---------------------------------------------------------------------------------------------------
def _encode(jsm: Any, tokenizer: Any, processor: Any, record: dict[str, Any]) -> tuple[Any, list[int]]:
    from clef_finetune.data import normalize_label

    encoded = jsm.encode_record(tokenizer, record, max_length=4096,
                                processor=processor if record.get("images") else None)
    targets = [question.option_ids.index(normalize_label(record["questions"][question.question_id],
                                                         record["labels"][question.question_id]))
               for question in encoded.questions]
    return encoded, targets


def _hidden_states(model: Any, batch: dict[str, Any]) -> Any:
    """The backbone's last hidden states for a collated batch, exactly as the release's `ClefModel.forward`."""
    language_model = model.language_model
    base_model = language_model.get_base_model() if hasattr(language_model, "get_base_model") else language_model
    media = batch.get("media") or {}
    text_model = base_model.model
    if not media and hasattr(text_model, "language_model"):
        text_model = text_model.language_model
    return text_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                      return_dict=True, **media).last_hidden_state


def _batch_loss(logits: Any, chunk: list[int], encoded: list, records: list, settings: TrainSettings,
                smoothing: float) -> Any:
    """clef-finetune's `question_loss` (label-smoothed CE + Brier) averaged over the batch's questions."""
    import torch
    from clef_finetune.losses import question_loss

    losses = []
    for record_logits, index in zip(logits, chunk, strict=False):
        record = records[index]
        for question, question_logits, target in zip(encoded[index][0].questions, record_logits, encoded[index][1], strict=False):
            loss, _ = question_loss(question_logits, target, record["questions"][question.question_id]["type"],
                                    smoothing, settings.brier_weight, 0.0)
            losses.append(loss)
    return torch.stack(losses).mean()


def _schedule(optimizer: Any, steps: int, warmup: int) -> Any:
    """clef-finetune's schedule (train.py): linear warm-up, then cosine to zero."""
    import torch

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def _batches(count: int, size: int, steps: int, rng: random.Random):
    """`steps` batches of record indices, reshuffled every epoch."""
    order: list[int] = []
    for _ in range(steps):
        chunk = []
        for _ in range(size):
            if not order:
                order = list(range(count))
                rng.shuffle(order)
            chunk.append(order.pop())
        yield chunk


@dataclass
class _HeadBatch:
    """Index tensors of a padded batch of encoded records for `_batched_head_logits` (built once per record set).

    B records, L positions, Q questions, O options, T option tokens (each padded to the batch's largest).
    """

    key_pad: Any  # [B, L] bool, True at padding
    last: Any  # [B] index of each record's last token
    question_mean: Any  # [B, Q, L] averaging over each question's instruction span
    option_mean: Any  # [B, O, L] averaging over each option's span
    token_mean: Any  # [B, O, T] averaging over each option's token ids
    token_ids: Any  # [B, T]
    option_question: Any  # [B, O] the question of each option
    question_valid: Any  # [B, Q] bool
    types: Any  # [B, Q]
    member: Any  # [B, Q, O] bool: option o belongs to question q (padded questions: every option)
    counts: list[list[int]]  # per record, options per question


def _head_batch(records: list[Any], length: int) -> _HeadBatch:
    """The `_HeadBatch` of release `EncodedRecord`s padded to `length` positions."""
    import torch

    size = len(records)
    n_q = max(len(r.questions) for r in records)
    n_o = max(sum(len(q.option_spans) for q in r.questions) for r in records)
    n_t = max(sum(end - start for q in r.questions for start, end in q.option_spans) for r in records)
    key_pad = torch.ones(size, length, dtype=torch.bool)
    last = torch.zeros(size, dtype=torch.long)
    question_mean = torch.zeros(size, n_q, length)
    option_mean = torch.zeros(size, n_o, length)
    token_mean = torch.zeros(size, n_o, n_t)
    token_ids = torch.zeros(size, n_t, dtype=torch.long)
    option_question = torch.zeros(size, n_o, dtype=torch.long)
    question_valid = torch.zeros(size, n_q, dtype=torch.bool)
    types = torch.zeros(size, n_q, dtype=torch.long)
    member = torch.ones(size, n_q, n_o, dtype=torch.bool)
    counts = []
    for b, record in enumerate(records):
        key_pad[b, : len(record.input_ids)] = False
        last[b] = len(record.input_ids) - 1
        option, token = 0, 0
        for q, question in enumerate(record.questions):
            start, end = question.question_span
            question_mean[b, q, start:end] = 1.0 / (end - start)
            question_valid[b, q] = True
            types[b, q] = question.question_type
            member[b, q] = False
            for start, end in question.option_spans:
                option_mean[b, option, start:end] = 1.0 / (end - start)
                token_mean[b, option, token: token + end - start] = 1.0 / (end - start)
                token_ids[b, token: token + end - start] = torch.tensor(record.input_ids[start:end])
                option_question[b, option] = q
                member[b, q, option] = True
                option, token = option + 1, token + end - start
        counts.append([len(q.option_spans) for q in record.questions])
    return _HeadBatch(key_pad, last, question_mean, option_mean, token_mean, token_ids, option_question,
                      question_valid, types, member, counts)


def _batched_head_logits(head: Any, hidden: Any, plan: _HeadBatch, lm_head: Any) -> list[list[Any]]:
    """The release `JointSchemaHead`'s option logits for a padded batch, computed for all records at once.

    The same modules and the same function of the hidden states as the release head's per-record loop (padding
    is masked out of every attention and softmax), so it trains the same parameters; it only batches the
    computation (the release loop costs ~20 ms of Python per record, most of a training step). Float32 results
    agree with the release head to rounding (tests/test_decision_eval.py). Training only: the release head
    scores every request.
    """
    import torch
    import torch.nn.functional as functional

    def gather(values: Any, index: Any) -> Any:  # values [B, Q, D], index [B, O] -> [B, O, D]
        return torch.gather(values, 1, index.unsqueeze(-1).expand(-1, -1, values.shape[-1]))

    head = getattr(head, "inner", head)  # clef-finetune's Fp32Head wraps the release head
    seq = head.hidden_norm(hidden.to(next(head.parameters()).dtype))
    memory = head.memory_projection(seq)
    global_vector = seq[torch.arange(seq.shape[0]), plan.last]
    questions = plan.question_mean @ seq
    contexts = plan.option_mean @ seq
    lexical = plan.token_mean @ lm_head.detach().to(seq.dtype)[plan.token_ids]
    routed = (head.option_context_projection(contexts) + head.option_lexical_projection(lexical)
              + gather(head.option_question_projection(questions), plan.option_question))
    for layer in head.evidence_layers:
        normalized_memory = layer.memory_norm(memory)
        attended, _ = layer.attention(layer.query_norm(routed), normalized_memory, normalized_memory,
                                      key_padding_mask=plan.key_pad, need_weights=False)
        routed = routed + layer.attention_dropout(attended)
        routed = routed + layer.feedforward(layer.feedforward_norm(routed))
    base = head.question_projection(questions)
    scores = (base @ routed.transpose(1, 2)) / math.sqrt(routed.shape[-1])
    weights = torch.softmax(scores.masked_fill(~plan.member, float("-inf")), dim=-1)
    fields = (base + head.option_summary_norm(weights @ routed) + head.global_projection(global_vector).unsqueeze(1)
              + head.type_embedding(plan.types))
    for decoder in head.layers:
        fields = decoder(fields, memory, tgt_key_padding_mask=~plan.question_valid,
                         memory_key_padding_mask=plan.key_pad)
    fields = head.field_norm(fields)
    anchor = gather(functional.normalize(questions + global_vector.unsqueeze(1), dim=-1), plan.option_question)
    prior = head.prior_logit_scale.clamp(max=math.log(100.0)).exp() * \
        (functional.normalize(lexical, dim=-1) * anchor).sum(-1)
    options = head.option_norm(routed)
    field = gather(fields, plan.option_question)
    features = torch.cat([field, options, field * options, torch.abs(field - options)], dim=-1)
    joint = head.joint_logit_scale.clamp(max=math.log(100.0)).exp() * \
        functional.cosine_similarity(field, options, dim=-1) + head.residual_scorer(features).squeeze(-1)
    logits = prior + torch.sigmoid(head.residual_gate) * joint
    return [list(torch.split(logits[b, : sum(counts)], counts)) for b, counts in enumerate(plan.counts)]


@dataclass
class _Assembly:
    """clef-finetune's training model for one base release: backbone (+LoRA), head and the release's encoder."""

    model: Any
    peft_model: Any
    head: Any
    tokenizer: Any
    processor: Any
    jsm: Any
    targets: list[str]


def _assemble(base: Path, settings: TrainSettings, seed: int) -> _Assembly:
    """clef-finetune's `build_training_model` on `base`: LoRA on decoder layers >= `lora_first_layer`, fp32 head."""
    from clef_finetune.model import DEFAULT_EXCLUDE, build_training_model
    from clef_finetune.train import load_config, seed_everything

    early = [rf"(^|\.)layers\.{index}\." for index in range(settings.lora_first_layer)]
    cfg = load_config(None, {
        "model": {"path": str(base), "dtype": "float32"},
        "lora": {"r": settings.lora_r, "alpha": settings.lora_alpha, "dropout": 0.0,
                 "exclude_patterns": list(DEFAULT_EXCLUDE) + early},
        "train": {"seed": seed, "gradient_checkpointing": False, "train_head": True, "head_dtype": "float32",
                  "label_smoothing": settings.label_smoothing, "brier_weight": settings.brier_weight},
    })
    seed_everything(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # clef-finetune prints its target list
        model, peft_model, head, tokenizer, processor, jsm, _, targets = build_training_model(cfg, "cpu")
    return _Assembly(model, peft_model, head, tokenizer, processor, jsm, list(targets))


def _lora_stage(asm: _Assembly, base: Path, encoded: list, records: list[dict[str, Any]], settings: TrainSettings,
                rng: random.Random) -> tuple[Any, list[float]]:
    """Stage 1: LoRA + head with clef-finetune's recipe, batched; then merge LoRA and round to the release's bf16.

    Returns (merged backbone, losses). The rounding makes the head's next stage read what the release will read.
    """
    import torch

    cpu = torch.device("cpu")
    started = time.perf_counter()
    head_params = [p for p in asm.head.parameters() if p.requires_grad]
    lora_params = [p for p in asm.peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": lora_params, "lr": settings.lr},
                                   {"params": head_params, "lr": settings.head_lr}], weight_decay=0.0)
    scheduler = _schedule(optimizer, settings.lora_steps, min(settings.warmup_steps, max(1, settings.lora_steps)))
    asm.model.train()
    losses: list[float] = []
    for chunk in _batches(len(encoded), settings.batch_size, settings.lora_steps, rng):
        batch = asm.jsm.collate_records([encoded[i][0] for i in chunk], asm.tokenizer.pad_token_id, cpu)
        loss = _batch_loss(asm.model(batch), chunk, encoded, records, settings, settings.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lora_params + head_params, settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        _log(f"LoRA step {len(losses)}/{settings.lora_steps} loss {loss.item():.4f} "
             f"({time.perf_counter() - started:.0f} s)")
    asm.model.eval()
    merged = asm.peft_model.merge_and_unload()
    reader = CheckpointReader(base)
    with torch.no_grad():  # round to the release's stored dtype (bf16): the head trains on what it will read
        for name, module in merged.named_modules():
            if isinstance(module, torch.nn.Linear) and name + ".weight" in reader:
                stored = reader.tensor(name + ".weight")
                module.weight.copy_(module.weight.to(stored.dtype).to(module.weight.dtype))
    return merged, losses


def _all_hidden_states(asm: _Assembly, encoded: list) -> list[Any]:
    """The (merged, frozen) backbone's last hidden states of every record, one record per pass (batching does not
    pay on CPU here: the linear attention's reference kernel is a Python loop over chunks)."""
    import torch

    cpu = torch.device("cpu")
    hidden = []
    with torch.no_grad():
        for item in encoded:
            batch = asm.jsm.collate_records([item[0]], asm.tokenizer.pad_token_id, cpu)
            hidden.append(_hidden_states(asm.model, batch)[0])
    return hidden


def _head_stage(asm: _Assembly, encoded: list, records: list[dict[str, Any]], hidden: list[Any],
                settings: TrainSettings, rng: random.Random) -> list[float]:
    """Stage 2: the joint head alone on cached hidden states (the backbone is frozen, so they cannot change)."""
    import torch

    started = time.perf_counter()
    head_params = [p for p in asm.head.parameters() if p.requires_grad]
    lm_head = asm.model.language_model.get_output_embeddings().weight
    optimizer = torch.optim.AdamW(head_params, lr=settings.head_stage_lr, weight_decay=settings.head_weight_decay)
    scheduler = _schedule(optimizer, settings.head_steps, settings.warmup_steps)
    noise = torch.Generator().manual_seed(rng.randrange(1 << 31))
    asm.head.train()
    losses: list[float] = []
    for chunk in _batches(len(encoded), settings.head_batch_size, settings.head_steps, rng):
        length = max(hidden[i].shape[0] for i in chunk)
        states = torch.zeros(len(chunk), length, hidden[0].shape[-1])
        for row, i in enumerate(chunk):
            states[row, : hidden[i].shape[0]] = hidden[i]
        if settings.head_noise > 0:  # noise relative to each position's RMS: irrelevant tokens move states too
            rms = states.pow(2).mean(-1, keepdim=True).sqrt()
            states = states + settings.head_noise * rms * torch.randn(states.shape, generator=noise)
        logits = _batched_head_logits(asm.head, states, _head_batch([encoded[i][0] for i in chunk], length), lm_head)
        loss = _batch_loss(logits, chunk, encoded, records, settings, settings.head_label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head_params, settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if len(losses) % 50 == 0:
            _log(f"head step {len(losses)}/{settings.head_steps} loss {sum(losses[-50:]) / 50:.4f} "
                 f"({time.perf_counter() - started:.0f} s)")
    asm.head.eval()
    return losses


def _train(base: Path, records: list[dict[str, Any]], settings: TrainSettings, seed: int) -> tuple[Any, Any, dict]:
    """Fine-tune LoRA + head (stage 1), merge, then the head alone (stage 2); returns (merged, head, log)."""
    started = time.perf_counter()
    asm = _assemble(base, settings, seed)
    encoded = [_encode(asm.jsm, asm.tokenizer, asm.processor, record) for record in records]
    rng = random.Random(seed)
    merged, lora_loss = _lora_stage(asm, base, encoded, records, settings, rng)
    hidden = _all_hidden_states(asm, encoded)
    _log(f"hidden states of {len(encoded)} records ({time.perf_counter() - started:.0f} s)")
    head_loss = _head_stage(asm, encoded, records, hidden, settings, rng)
    log = {"lora_targets": len(asm.targets), "head_loss_first": round(head_loss[0], 4) if head_loss else None,
           "head_loss_last50": round(sum(head_loss[-50:]) / max(1, len(head_loss[-50:])), 4),
           "lora_loss_last": round(lora_loss[-1], 4) if lora_loss else None,
           "train_seconds": round(time.perf_counter() - started, 1)}
    return merged, asm.head, log


def _write_trained(base: Path, out: Path, merged: Any, head: Any) -> list[str]:
    """Copy the base release into `out` with the merged LoRA tensors and the trained head; returns changed names."""
    import torch

    reader = CheckpointReader(base)
    live = {name: module.weight for name, module in merged.named_modules()
            if isinstance(module, torch.nn.Linear)}
    replaced: dict[str, Any] = {}
    for name, weight in live.items():
        disk = name + ".weight"
        if disk not in reader:
            continue
        stored = reader.tensor(disk)
        new = weight.detach().to(stored.dtype)
        if not torch.equal(new, stored):
            replaced[disk] = new.contiguous()
    for path in base.iterdir():
        if path.is_file() and not path.name.startswith("model") and path.name != "joint_head.safetensors":
            shutil.copy2(path, out / path.name)
    layout = [(name, reader.dtype(name), reader.shape(name)) for name in reader.names()]
    writer = ShardedWriter(out, max_shard_bytes=400_000, layout=layout)
    with writer:
        for name in reader.names():
            if name in replaced:
                writer.add_tensor(name, replaced[name])
            else:
                writer.copy_from(reader, name)
        writer.close()
    head_writer = ShardedWriter(out / ".joint_head", max_shard_bytes=1 << 62)
    with head_writer:
        for name, tensor in head.state_dict().items():
            head_writer.add_tensor(name, tensor.detach().float().contiguous())
        head_writer.close()
    (out / ".joint_head" / "model-00001-of-00001.safetensors").rename(out / "joint_head.safetensors")
    shutil.rmtree(out / ".joint_head")
    return sorted(replaced)


def _with_images(records: list[dict[str, Any]], rate: float, seed: int, offset: int) -> list[dict[str, Any]]:
    """Attach an uninformative PIL image to about `rate` of the records (in memory, for training)."""
    rng = random.Random(f"images:{seed}")
    out = []
    for index, record in enumerate(records):
        if rng.random() < rate:
            record = dict(record, images=[_pil(photo_png(offset + index))])
        out.append(record)
    return out


def _eval_lines(records: list[dict[str, Any]], folder: Path) -> str:
    """The held-out records as JSONL; records 0 and 1 carry a data: URI image, record 2 a relative PNG path."""
    lines = []
    (folder / IMAGES_DIR).mkdir(exist_ok=True)
    for index, record in enumerate(records):
        record = dict(record)
        if index in (0, 1):
            record["images"] = [data_uri(photo_png(100_000 + index))]
        elif index == 2:
            name = f"{IMAGES_DIR}/photo-{index}.png"
            (folder / name).write_bytes(photo_png(100_000 + index))
            record["images"] = [name]
        lines.append(json.dumps(record, ensure_ascii=False, sort_keys=False))
    return "\n".join(lines) + "\n"


def _build(folder: Path, seed: int, settings: TrainSettings) -> None:
    """Build the trained release into the (empty, temporary) `folder`."""
    import torch

    from clef_model.decision_data import generate
    from clef_model.fixtures import build_fixture

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared CPUs: more threads made training several times slower (measured)
    try:
        scratch = folder.parent / (folder.name + ".base")
        shutil.rmtree(scratch, ignore_errors=True)
        base = build_fixture(scratch, "tiny", seed=seed, progress=False)
        _log(f"random tiny base built ({time.perf_counter() - started:.0f} s)")
        train = _with_images(generate(settings.train_records, seed=seed, split="train"), settings.image_rate, seed, 0)
        merged, head, log = _train(base, train, settings, seed)
        changed = _write_trained(base, folder, merged, head)
        shutil.rmtree(scratch, ignore_errors=True)
    finally:
        torch.set_num_threads(threads)
    heldout = generate(settings.eval_records, seed=seed, split="eval")
    (folder / EVAL_FILE).write_text(_eval_lines(heldout, folder), encoding="utf-8")
    info = {"seed": seed, "settings": asdict(settings), "trainer": "clef-finetune 0.1.0 (model assembly, loss, schedule; "
            "two-stage loop and layout-keeping export by blaze)", "changed_tensors": len(changed), **log,
            "build_seconds": round(time.perf_counter() - started, 1)}
    (folder / TRAIN_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    for path in folder.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)
    _log(f"trained release built in {info['build_seconds']} s")


def _cache_key(seed: int, settings: TrainSettings) -> str:
    """What the cached release depends on: the seed, the settings, this code and the libraries' versions."""
    from importlib.metadata import version

    digest = hashlib.sha256(f"build {BUILD_VERSION}".encode())
    here = Path(__file__).resolve().parent
    for name in ("decision_data.py", "fixtures.py", "_fixture_corpus.py"):
        digest.update((here / name).read_bytes())
    for package in ("torch", "transformers", "peft", "clef-finetune", "tokenizers"):
        digest.update(f"{package}={version(package)}".encode())
    digest.update(json.dumps(asdict(settings), sort_keys=True).encode())
    return f"decisions-seed{seed}-{digest.hexdigest()[:16]}"


def cached_decision_fixture(seed: int = 0, settings: TrainSettings | None = None) -> Path:
    """The trained release in blaze's cache, built on first use (one build at a time, atomically)."""
    from clef_model.env import cache_root

    settings = settings or TrainSettings()
    root = cache_root() / "fixtures"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / _cache_key(seed, settings)
    if (folder / EVAL_FILE).is_file():
        return folder
    with open(root / ".decisions.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / EVAL_FILE).is_file():
            return folder
        with atomic_output(folder, force=True) as tmp:
            _build(Path(tmp), seed, settings)
    return folder


def dev_lines(seed: int = 0) -> str:
    """The `dev` split as JSONL (labelled SystemOne requests, text only): `DEV_FILE`'s contents.

    Deterministic for the seed; its names are the dev split's own (never a training or eval name) and its
    records are neither trained on nor evaluated. It stands in for a user's own decision traffic, e.g.
    `blaze edit --preserve-requests OUT/decision_dev.jsonl`."""
    from clef_model.decision_data import generate

    records = generate(DEV_RECORDS, seed=seed, split="dev")
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def build_decision_fixture(out: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write the trained decision release (with `decision_eval.jsonl` and `decision_dev.jsonl`) to `out`;
    returns `out`.

    A non-empty `out` is refused unless `force`. The first call for a seed trains (≤ 3 min on 2 CPU
    cores); later calls copy the cached folder. `decision_dev.jsonl` is written here, at copy time, from
    `clef_model.decision_data` (not part of the cached build, so adding it changed no trained weight).
    """
    source = cached_decision_fixture(seed)
    out = Path(out)
    with atomic_output(out, force=force) as tmp:
        for path in source.rglob("*"):
            target = Path(tmp) / path.relative_to(source)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        (Path(tmp) / DEV_FILE).write_text(dev_lines(seed), encoding="utf-8")
    return out


def require_eval_file(folder: Path) -> Path:
    """The release's `decision_eval.jsonl`, or a BlazeError saying how to get one."""
    path = Path(folder) / EVAL_FILE
    if not path.is_file():
        raise BlazeError(f"{path} not found; build the release with `blaze fixture --preset decisions OUT`.")
    return path
