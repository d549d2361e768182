"""Supervised fine-tuning of a decoder (data.task: causal_lm) on prompt/completion JSON lines,
packed: what is particular to the task; `finetune.train` runs the loop.

    {"prompt": "Translate to French: cheese", "completion": "fromage"}     (TRL's format)

An example's tokens: the tokenizer's own leading special tokens (Llama's BOS; none for Qwen),
the prompt, the completion, EOS. Where the tokenizer has a chat template, the prompt is
rendered as one user turn with the assistant's opening (add_generation_prompt), as SFT
trainers render a conversational prompt. Labels are -100 on the prompt's tokens: the loss is
the completion's (and EOS's), as TRL's completion_only_loss. An example over
data.max_sequence_length keeps its first tokens (TRL truncates so) or, too_long: error, is
refused naming its line.

Packed rows keep examples apart (model.families: causal attention inside each sequence,
positions from 0 in each, token t predicting t + 1 only inside its own sequence), so the loss
of a packed batch is the sum of its examples' token losses over its predicted tokens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from packed_transformers.common.cli import first_line
from packed_transformers.components.run_state import Diverged
from packed_transformers.components.step import MeanLoss, predicted_tokens
from packed_transformers.data.assets import resolve_asset
from packed_transformers.data.classification_data import ExampleError, read_jsonl, split_by_seed
from packed_transformers.finetune.errors import FinetuneError
from packed_transformers.finetune.job_contract import Job, JobInput
from packed_transformers.inference.runner import Runner
from packed_transformers.model.families import IGNORED, next_token_targets
from packed_transformers.packs.batching import Batcher
from packed_transformers.packs.rows import pack_rows

log = logging.getLogger("finetune")


@dataclass
class PromptCompletions:
    """Raw examples in input order; where[i]: "file:line"."""

    prompts: list[str]
    completions: list[str]
    where: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, rows) -> PromptCompletions:
        pick = [int(i) for i in rows]
        return PromptCompletions(
            *([column[i] for i in pick] for column in (self.prompts, self.completions, self.where))
        )


@dataclass
class CausalExamples:
    """token_ids[i], segment_ids[i] (zeros), label_ids[i] (-100 on the prompt): int64
    [length_i]; truncated: examples cut to data.max_sequence_length."""

    token_ids: list[np.ndarray]
    segment_ids: list[np.ndarray]
    label_ids: list[np.ndarray]
    truncated: int

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.token_ids], dtype=np.int64)

    @property
    def predicted_tokens(self) -> int:
        """Tokens with a target: every labelled token but each example's first."""
        return int(sum(int((labels[1:] != IGNORED).sum()) for labels in self.label_ids))


def read_prompt_completions(path, prompt_field: str, completion_field: str) -> PromptCompletions:
    """One example per non-blank line, read as classification's JSON lines are
    (data.classification_data.read_jsonl: UTF-8, a JSON object, string fields of at most
    MAX_FIELD_CHARS); the completion is required."""
    examples = read_jsonl(path, prompt_field, completion_field, None, need_labels=False)
    for completion, where in zip(examples.pairs, examples.where):
        if completion is None:
            raise ExampleError(
                f"{where}: field '{completion_field}' is missing (a string: what the model learns)"
            )
    return PromptCompletions(examples.texts, examples.pairs, examples.where)


def leading_specials(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text of its own accord (Llama's BOS;
    none for Qwen or GPT-2); a trailing special it adds (an embedder's EOS) is not taken."""
    probe = "a b"
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start])
    return []


def render_prompt(tokenizer, prompt: str, where: str) -> str:
    """The prompt as one user turn with the assistant's opening, through the tokenizer's chat
    template; a template that fails is ExampleError naming the example (not a traceback)."""
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    except Exception as err:  # noqa: BLE001 - jinja2's errors and the template's own raise_exception
        raise ExampleError(
            f"{where}: the tokenizer's chat template cannot render this prompt ({type(err).__name__}: "
            f"{first_line(err)[:200]})"
        ) from None


def encode_examples(examples: PromptCompletions, tokenizer, max_length: int, too_long: str) -> CausalExamples:
    """Prompt/completion text -> token ids and labels (module docstring)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    head = [] if chat else leading_specials(tokenizer)  # a chat template writes its own
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompts = [
        render_prompt(tokenizer, p, where) if chat else p
        for p, where in zip(examples.prompts, examples.where)
    ]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(examples.completions, add_special_tokens=False)["input_ids"]
    out, truncated = CausalExamples([], [], [], 0), 0
    for prompt, completion, where in zip(prompt_ids, completion_ids, examples.where):
        ids = np.array(head + list(prompt) + list(completion) + eos, dtype=np.int64)
        labels = ids.copy()
        labels[: len(head) + len(prompt)] = IGNORED
        if len(ids) > max_length:
            if too_long == "error":
                raise ExampleError(
                    f"{where}: {len(ids)} tokens, more than data.max_sequence_length {max_length} (too_long: error)"
                )
            ids, labels, truncated = ids[:max_length], labels[:max_length], truncated + 1
        out.token_ids.append(ids)
        out.segment_ids.append(np.zeros_like(ids))
        out.label_ids.append(labels)
    out.truncated = truncated
    return out


def collate_causal(data: CausalExamples, table: np.ndarray, width: int, with_labels: bool = True) -> dict:
    """Model inputs of one batch table: the packed rows (packs.rows.pack_rows) and
    shift_labels [rows, width]: each token's next-token target inside its own sequence."""
    rows = pack_rows(data.token_ids, table, width, data.segment_ids)
    batch = {name: torch.from_numpy(value) for name, value in rows.items()}
    if with_labels:
        labels = torch.from_numpy(pack_rows(data.label_ids, table, width)["input_ids"])
        batch["shift_labels"] = next_token_targets(labels, batch["sequence_ids"])
    return batch


def correct_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """bool [B, S]: the tokens whose argmax is their next-token target (-100: never)."""
    return (logits.argmax(-1) == targets) & (targets != IGNORED)


def token_sums(out: dict, batch: dict) -> dict:
    """The causal LM's outputs -> the step's sums: the loss over its predicted tokens and the
    next-token accuracy (argmax = the target). A training step's outputs hold the predicted
    tokens' logits alone (model.families.predicted_token_outputs), evaluation's every token's."""
    if out.get("predicted_logits") is not None:
        correct = correct_tokens(out["predicted_logits"], out["predicted_targets"]).sum()
    else:
        correct = correct_tokens(out["logits"], batch["shift_labels"].to(out["logits"].device)).sum()
    count = float(out["token_count"])
    return {
        "loss_sum": float(out["token_loss_sum"]),
        "count": count,
        "correct": float(correct),
        "correct_count": count,
    }


def per_example_losses(
    model, data: CausalExamples, batcher: Batcher
) -> tuple[np.ndarray, np.ndarray, int, dict]:
    """Summed token loss and predicted-token count per example (float64 [n], int64 [n], input
    order), the tokens predicted right, and the pass's timing and padding figures. The
    forward is inference.runner's (on the model's device, float32), given each token's
    next-token target so that the LM head runs only on the predicted tokens (skip_logits:
    no [rows, width, vocabulary] logits); the loss is reduced on the device."""
    runner = model if isinstance(model, Runner) else Runner(model)
    tables = batcher.epoch(0, shuffle=False)
    loss_sums, counts, correct = np.zeros(len(data)), np.zeros(len(data), dtype=np.int64), 0

    def targets_of(labels):
        """The model's extra inputs, given the table's labels [rows, width]: each token's
        next-token target inside its own sequence (from the rows the runner packed)."""
        return lambda batch: {
            "shift_labels": next_token_targets(
                labels.to(batch["sequence_ids"].device), batch["sequence_ids"]
            ),
            "skip_logits": True,
        }

    def read(batch, out):
        """The reduction on the device: each predicted token's loss (the head's tokens come
        in row-major order, as the mask below selects them) and its example."""
        logits, targets = out["predicted_logits"].float(), out["predicted_targets"]
        token_loss = F.cross_entropy(logits, targets, reduction="none")  # [N]
        slots = batch["sequence_ids"].clamp(min=1) - 1  # a token's slot in its row's table
        example = torch.gather(batch["example_index"], 1, slots)
        return {
            "example": example[batch["shift_labels"] != IGNORED].cpu().numpy(),
            "loss": token_loss.double().cpu().numpy(),
            "correct": np.array([int(correct_tokens(logits, targets).sum())]),
        }

    start = time.perf_counter()
    for table in tables:
        width = batcher.width(table)
        labels = torch.from_numpy(pack_rows(data.label_ids, table, width)["input_ids"])
        got = runner.forward(
            data.token_ids, table, width, data.segment_ids, read=read, inputs=targets_of(labels)
        ).outputs
        np.add.at(loss_sums, got["example"], got["loss"])
        np.add.at(counts, got["example"], 1)
        correct += int(got["correct"][0])
    seconds = time.perf_counter() - start
    timing = {"examples": len(data), "seconds": seconds, "examples_per_second": len(data) / seconds,
              "batches": len(tables), "padding_fraction": batcher.padding_fraction(tables)}  # fmt: skip
    return loss_sums, counts, correct, timing


def score_losses(loss_sums: np.ndarray, counts: np.ndarray, correct: int) -> dict:
    """Token-weighted loss over every predicted token, its perplexity, next-token accuracy."""
    tokens = max(int(counts.sum()), 1)
    loss = float(loss_sums.sum() / tokens)
    if not math.isfinite(loss):
        raise Diverged("validation loss is not finite: the run diverged (lower optim.lr?); nothing saved")
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "token_accuracy": correct / tokens}


def write_losses(path: Path, loss_sums: np.ndarray, counts: np.ndarray) -> None:
    """validation_predictions.jsonl: per example in input order, its mean token loss and the
    tokens it was scored on (0: its completion was cut off; loss null)."""
    from packed_transformers.common.files import atomic_path

    lines = [
        f'{{"loss": {loss / count if count else "null"}, "tokens": {int(count)}}}'
        for loss, count in zip(loss_sums.tolist(), counts.tolist())
    ]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))


def causal_lm_job(config: dict, checkpoint_config: dict | None = None):
    """The Job (finetune.jobs) of a causal-LM run: examples read and split, tokenized with the
    checkpoint's tokenizer and checked; -> the builder that opens the decoder's packed causal
    LM for training.
    checkpoint_config: the checkpoint's config.json as read (None: read here), handed to the
    tokenizer and the door so that nothing reads it again."""
    from packed_transformers.door.folder import FolderTokenizer, auto_tokenizer, check_vocabulary_size
    from packed_transformers.door.folder_spec import read_json_object
    from packed_transformers.door.opener import ForTraining, open_folder
    from packed_transformers.model.opening import ModelOptions

    data, model_cfg = config["data"], config["model"]
    checkpoint = resolve_asset(model_cfg["init_checkpoint"])
    model_config = checkpoint_config or read_json_object(Path(checkpoint) / "config.json")
    try:
        tokenizer = auto_tokenizer(Path(checkpoint), model_config)
    except (OSError, ValueError) as err:
        raise FinetuneError(
            f"model.init_checkpoint {checkpoint}: no tokenizer transformers can load ({err})"
        ) from None
    # the tokenizer must fit the embedding table before any example is read or packed
    check_vocabulary_size(Path(checkpoint), model_config.get("vocab_size"), len(tokenizer))
    examples = read_prompt_completions(
        resolve_asset(data["train_file"]), data["prompt_field"], data["completion_field"]
    )
    if data["validation_file"] is None:
        train_rows, val_rows = split_by_seed(len(examples), data["validation_fraction"], data["split_seed"])
        train_text, validation_text = examples.subset(train_rows), examples.subset(val_rows)
    else:
        train_text = examples
        validation_text = read_prompt_completions(
            resolve_asset(data["validation_file"]), data["prompt_field"], data["completion_field"]
        )
    length, too_long = data["max_sequence_length"], data["too_long"]
    train, validation = (
        encode_examples(part, tokenizer, length, too_long) for part in (train_text, validation_text)
    )
    for name, part in (("train", train), ("validation", validation)):
        if part.truncated:
            log.warning(
                "%s: %d of %d examples truncated to %d tokens", name, part.truncated, len(part), length
            )
        if part.predicted_tokens == 0:
            cause = (
                f"survives truncation to {length} tokens" if part.truncated
                else "in any example: every completion is empty and the tokenizer has no EOS token to end one"
            )  # fmt: skip
            raise ExampleError(f"data.{name}_file: no completion token {cause}: nothing to learn from")

    def build():  # the model, once the input above is read and checked
        torch.manual_seed(config["training"]["seed"])
        options = ModelOptions(
            new_head=False,  # the LM head is the checkpoint's (tied or its own): a missing one is an error
            dropout={"hidden": model_cfg["hidden_dropout"], "attention": model_cfg["attention_dropout"]},
        )
        carried = FolderTokenizer(  # the tokenizer above, built once: the LoadedModel carries it
            tokenizer.backend_tokenizer, "token_type_ids" in tokenizer.model_input_names,
            tokenizer.eos_token_id, transformers_tokenizer=tokenizer,
        )  # fmt: skip
        opened = open_folder(
            checkpoint, ForTraining("causal_lm", options, model_config, f"model.init_checkpoint {checkpoint}",
                                    tokenizer=carried),
        )  # fmt: skip
        if int(max(train.lengths.max(), validation.lengths.max())) > opened.max_length:
            raise FinetuneError(
                f"data.max_sequence_length: examples exceed the checkpoint's {opened.max_length} positions"
            )

        def evaluate(model, batcher):
            loss_sums, counts, correct, timing = per_example_losses(model, validation, batcher)
            return score_losses(loss_sums, counts, correct), timing, (loss_sums, counts)

        def save(model, folder: Path) -> None:
            model.save_pretrained(folder)  # AutoModelForCausalLM's folder, written atomically
            tokenizer.save_pretrained(folder)

        return Job(
            train, validation, opened, evaluate,
            lambda output, losses: write_losses(output / "validation_predictions.jsonl", *losses),
            save, f"{len(train)} / {len(validation)} prompt-completion examples ({train.predicted_tokens:,} trained tokens)",
            collate_causal, MeanLoss(predicted_tokens, "token_count", token_sums),
        )  # fmt: skip

    return JobInput(train, validation, build)
