"""Packing for Hugging Face users: a tokenized `datasets.Dataset` in, transformers'
`Trainer` and pipeline-style inference out.

    packed = pack_dataset(tokenized, task="single_label_classification", max_sequence_length=256)
    model = PackedBertForSequenceClassification.from_pretrained(checkpoint, num_labels=5, new_head=True)
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=packed,
                      eval_dataset=packed_eval, data_collator=PackedDataCollator(),
                      compute_metrics=packed_metrics("single_label_classification", my_metrics))
    trainer.train(); trainer.evaluate(); trainer.save_model(out)  # out loads in BertForSequenceClassification
    # compiled: TrainingArguments(torch_compile=True, ...) with PackedDataCollator(packs_per_batch=
    # per_device_train_batch_size): one graph for the run (an epoch's short last batch filled)
    predict = packed_pipeline("text-classification", model=out)
    predict(["a text", ...])    # [{"label": ..., "score": ...}, ...] in input order

Other encoder families (RoBERTa, XLM-R, DeBERTa-v2, ModernBERT, MPNet, ... model/families.py)
take the same packs, tokenized by their own tokenizer, with the family's model in place of
the BERT head (every task; the saved folder loads in the family's Auto class):
    model = PackedFamilyModel.from_pretrained(folder, "classification", num_labels=5, new_head=True)
    # "token_classification" | "question_answering"; problem_type= for multi-label

Tasks (pack_dataset's `task`, the columns it reads):
  single_label_classification  input_ids, token_type_ids (optional), an int label column
  multi_label_classification   the same with a list of C numbers in 0..1 per example
  question_answering           windows as transformers' run_qa.py prepares them:
                               input_ids, token_type_ids, start_positions, end_positions
  token_classification         a list of per-token labels (-100 = ignored) per example
  causal_lm                    input_ids, and optionally per-token labels (-100 on prompt
                               tokens: completion-only loss); an example longer than
                               max_sequence_length keeps its first tokens (as TRL truncates),
                               or with split_long=True is cut into pieces of at most that
                               many tokens, each its own sequence (pretraining text)

A pack holds up to K examples back to back (positions restart, block-diagonal attention);
its columns: input_ids, segment_ids, position_ids, sequence_ids [S]; cls_positions,
example_index [K] (-1 = empty slot); labels: [K] (classification, -100 empty), [K, C]
(multi-label), [K, 2] (QA start/end inside each window), [S] (token classification,
causal LM); causal LM also shift_labels [S]: each token's next-token target inside its own
sequence (-100 at a sequence's last token and on padding), which Trainer counts as the
step's `num_items_in_batch` and the decoder takes as is (model/families.py).
Trainer then needs nothing special: the packed models are PreTrainedModels that accept
its `num_items_in_batch` (gradient accumulation normalises over the step's examples),
and `packed_metrics` turns its gathered per-slot outputs into one row per example, in
input order, with the exact mean per-example eval loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.histogram import check_positive_int
from packed_transformers.packs.rows import pack_rows, unpack_outputs, unpack_token_outputs
from packed_transformers.packs.tokenized import pack_examples

TASKS = (
    "single_label_classification",
    "multi_label_classification",
    "question_answering",
    "token_classification",
    "causal_lm",
)
IGNORED = -100  # transformers' "no label" value


class PackedDatasetError(ValueError):
    """A dataset pack_dataset cannot pack; the message names the column and row."""


# ----- datasets in ---------------------------------------------------------------------------
def _column(dataset, name: str, why: str) -> list:
    if name not in dataset.column_names:
        raise PackedDatasetError(
            f"the dataset has no column '{name}' ({why}); its columns: {', '.join(dataset.column_names)}"
        )
    return dataset[name]


def _shown(value) -> str:
    return repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."


def _integers(value, column: str, row: int, ndim: int = 1) -> np.ndarray:
    """One row's value -> int64 array of `ndim` dimensions (1: a list of integers, 0: one
    integer); None, floats, strings and booleans are refused with the column and row."""
    array = np.asarray(value) if value is not None else None
    empty_list = array is not None and ndim == 1 and array.shape == (0,)  # numpy types [] as float
    if not empty_list and (array is None or array.ndim != ndim or not np.issubdtype(array.dtype, np.integer)):
        what = "a list of integers" if ndim == 1 else "an integer"
        raise PackedDatasetError(f"column '{column}', row {row}: expected {what}, got {_shown(value)}")
    return array.astype(np.int64)


def _integer_column(values, column: str) -> np.ndarray:
    """A column of one integer per row -> int64 [n], or one line naming the first bad row."""
    array = np.asarray(values) if all(v is not None for v in values) else None
    if array is None or array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        for row, value in enumerate(values):  # raises at the first row that is not one integer
            _integers(value, column, row, ndim=0)
    return array.astype(np.int64)


def _rows_of(dataset):
    """The dataset, refused in one line unless it is a map-style `datasets.Dataset` with rows."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        streaming = type(dataset).__name__ == "IterableDataset"
        raise PackedDatasetError(
            "expected a datasets.Dataset; "
            + (
                "an IterableDataset (streaming) cannot be packed offline: packing needs every length first "
                "(materialize it, e.g. Dataset.from_list(list(iterable_dataset.take(n))))"
                if streaming
                else f"got {type(dataset).__name__}"
            )
        )
    if len(dataset) == 0:
        raise PackedDatasetError("the dataset has no rows; there is nothing to pack")
    return dataset


def _check_tokens(dataset, max_sequence_length: int):
    """-> token and segment id arrays per example, checked: integers >= 0, no padding,
    within the length, segment ids one per token."""
    tokens = _column(
        dataset, "input_ids", "tokenize the text first, e.g. dataset.map(tokenizer, batched=True)"
    )
    segments = dataset["token_type_ids"] if "token_type_ids" in dataset.column_names else None
    masks = dataset["attention_mask"] if "attention_mask" in dataset.column_names else None
    token_arrays, segment_arrays = [], []
    for row, ids in enumerate(tokens):
        ids = _integers(ids, "input_ids", row)
        if ids.size == 0:
            raise PackedDatasetError(f"column 'input_ids', row {row}: expected a non-empty list of token ids")
        if ids.min() < 0:
            raise PackedDatasetError(f"column 'input_ids', row {row}: token id {ids.min()} is negative")
        if ids.size > max_sequence_length:
            raise PackedDatasetError(
                f"column 'input_ids', row {row}: {ids.size} tokens, more than max_sequence_length "
                f"{max_sequence_length} (tokenize with truncation=True, max_length={max_sequence_length})"
            )
        if masks is not None:
            mask = _integers(masks[row], "attention_mask", row)
            if mask.shape != ids.shape or not mask.all():
                raise PackedDatasetError(
                    f"column 'attention_mask', row {row}: padding found (or a length other than "
                    f"input_ids'); tokenize without padding (packing replaces it)"
                )
        segment = np.zeros_like(ids) if segments is None else _integers(segments[row], "token_type_ids", row)
        if segment.shape != ids.shape or segment.min() < 0:
            raise PackedDatasetError(
                f"column 'token_type_ids', row {row}: expected {ids.size} segment ids >= 0 (one per "
                f"token), got {_shown(segments[row])}"
            )
        token_arrays.append(ids)
        segment_arrays.append(segment)
    return token_arrays, segment_arrays


def _labels(dataset, task: str, label_column: str | None, lengths: np.ndarray, num_labels: int | None):
    """Per-example labels, checked: int64 [n] | float32 [n, C] | int64 [n, 2] | list of int64 [L_i]."""
    if task == "question_answering":
        why = "run_qa.py's training features"
        starts = _integer_column(_column(dataset, "start_positions", why), "start_positions")
        ends = _integer_column(_column(dataset, "end_positions", why), "end_positions")
        bad = np.flatnonzero((starts < 0) | (ends < starts) | (ends >= lengths))
        if bad.size:
            row = int(bad[0])
            raise PackedDatasetError(
                f"columns 'start_positions'/'end_positions', row {row}: ({starts[row]}, {ends[row]}) is not "
                f"a span inside the window's {lengths[row]} tokens"
            )
        return np.stack([starts, ends], axis=1)
    column = label_column or ("labels" if "labels" in dataset.column_names else "label")
    values = _column(dataset, column, "the labels; name it with label_column=")
    if task == "single_label_classification":
        labels = _integer_column(values, column)
        if labels.min() < 0:
            row = int(np.argmin(labels))
            raise PackedDatasetError(
                f"column '{column}', row {row}: label {labels[row]} is negative (a whole-sequence label "
                f"cannot be ignored like a token's -100; drop the row or give it a class)"
            )
        limit = num_labels if num_labels is not None else int(labels.max()) + 1
        bad = np.flatnonzero(labels >= limit)  # negative ones refused above
        if bad.size:
            raise PackedDatasetError(
                f"column '{column}', row {int(bad[0])}: label {labels[bad[0]]} is outside 0..{limit - 1}"
            )
        return labels.astype(np.int64)
    if task == "multi_label_classification":
        try:
            labels = np.asarray(values, dtype=np.float32)
        except (ValueError, TypeError):  # rows of different widths, None, strings
            width = None
            for row, value in enumerate(values):
                try:
                    numbers = np.asarray(value, dtype=np.float32)
                except (ValueError, TypeError):
                    numbers = None
                if numbers is None or numbers.ndim != 1 or numbers.size != (width or numbers.size):
                    raise PackedDatasetError(
                        f"column '{column}', row {row}: expected a list of {width or 'C'} numbers in 0..1 "
                        f"(C the same in every row), got {_shown(value)}"
                    ) from None
                width = numbers.size
            raise
        if labels.ndim != 2 or (num_labels is not None and labels.shape[1] != num_labels):
            raise PackedDatasetError(
                f"column '{column}': expected [rows, {num_labels or 'C'}] numbers in 0..1"
            )
        bad = np.flatnonzero(~((labels >= 0) & (labels <= 1)).all(axis=1))  # NaN included
        if bad.size:
            raise PackedDatasetError(
                f"column '{column}', row {int(bad[0])}: values must lie in 0..1, got {_shown(values[bad[0]])}"
            )
        return labels
    out = []
    for row, (per_token, length) in enumerate(zip(values, lengths)):
        per_token = _integers(per_token, column, row)
        if per_token.shape != (length,):
            raise PackedDatasetError(
                f"column '{column}', row {row}: {per_token.size} labels for {length} tokens (one per token, "
                f"-100 where none)"
            )
        wrong = (per_token != IGNORED) & (
            (per_token < 0) | (num_labels is not None and per_token >= num_labels)
        )
        if wrong.any():
            raise PackedDatasetError(
                f"column '{column}', row {row}: label {per_token[wrong][0]} is outside 0..{(num_labels or 0) - 1}"
            )
        out.append(per_token)
    return out


def _causal_examples(dataset, max_length: int, label_column: str | None, split_long: bool):
    """Causal-LM examples -> (token arrays, label arrays, how many were longer than max_length):
    labels per token from `label_column` (default "labels" where the dataset has it) or the
    tokens themselves; -100 marks a token that is not predicted (a prompt's)."""
    ids_column = _column(dataset, "input_ids", "tokenize the text first, e.g. dataset.map(tokenizer)")
    column = label_column or ("labels" if "labels" in dataset.column_names else None)
    label_rows = _column(dataset, column, "per-token labels") if column else None
    tokens, labels, cut = [], [], 0
    for row, ids in enumerate(ids_column):
        ids = _integers(ids, "input_ids", row)
        if ids.size == 0 or ids.min() < 0:
            raise PackedDatasetError(
                f"column 'input_ids', row {row}: expected a non-empty list of token ids >= 0"
            )
        own = ids.copy() if label_rows is None else _integers(label_rows[row], column, row)
        if own.shape != ids.shape or ((own != IGNORED) & (own < 0)).any():
            raise PackedDatasetError(
                f"column '{column}', row {row}: expected {ids.size} labels (one per token: a token id, or -100 "
                f"where it is not predicted), got {_shown(label_rows[row])}"
            )
        if ids.size > max_length:
            cut += 1
            if split_long:
                starts = range(0, ids.size, max_length)
                tokens += [ids[s : s + max_length] for s in starts]
                labels += [own[s : s + max_length] for s in starts]
                continue
            ids, own = ids[:max_length], own[:max_length]
        tokens.append(ids)
        labels.append(own)
    return tokens, labels, cut


def pack_dataset(
    dataset,
    task: str,
    max_sequence_length: int,
    max_sequences_per_pack: int | None = None,
    algorithm: str = "lpfhp",
    label_column: str | None = None,
    num_labels: int | None = None,
    seed: int = 0,
    verbose: bool = True,
    split_long: bool = False,
):
    """A tokenized dataset (one example per row, unpadded) -> a `datasets.Dataset` of packs
    of `max_sequence_length` tokens (see the module docstring for the columns). Every
    example is in exactly one slot; `example_index` maps slots back to rows."""
    from datasets import Dataset

    if task not in TASKS:
        raise PackedDatasetError(f"task {task!r}: expected one of {', '.join(TASKS)}")
    from packed_transformers.packs.errors import PackingInputError
    from packed_transformers.packs.histogram import check_sequence_length

    try:
        check_sequence_length("max_sequence_length", max_sequence_length)
    except PackingInputError as err:
        raise PackedDatasetError(str(err)) from None
    started = time.perf_counter()
    dataset = _rows_of(dataset)
    if task == "causal_lm":
        tokens, labels, cut = _causal_examples(dataset, max_sequence_length, label_column, split_long)
        segments = [np.zeros_like(t) for t in tokens]
        lengths = np.array([t.size for t in tokens], dtype=np.int64)
    else:
        tokens, segments = _check_tokens(dataset, max_sequence_length)
        lengths = np.array([t.size for t in tokens], dtype=np.int64)
        labels = _labels(dataset, task, label_column, lengths, num_labels)
    try:
        table = pack_examples(lengths, max_sequence_length, max_sequences_per_pack, algorithm, seed)
    except PackingInputError as err:
        raise PackedDatasetError(str(err)) from None
    rows = pack_rows(tokens, table, max_sequence_length, segments)
    present = table >= 0
    if task in ("token_classification", "causal_lm"):
        packed_labels = np.full((len(table), max_sequence_length), IGNORED, dtype=np.int64)
        for pack, slots in enumerate(table):
            for slot, example in enumerate(slots):
                if example >= 0:
                    first = rows["cls_positions"][pack, slot]
                    packed_labels[pack, first : first + lengths[example]] = labels[example]
    else:
        packed_labels = labels[np.maximum(table, 0)].copy()
        packed_labels[~present] = IGNORED
    columns = {name: rows[name] for name in ("input_ids", "segment_ids", "position_ids", "sequence_ids")}
    columns.update(
        cls_positions=rows["cls_positions"], example_index=rows["example_index"], labels=packed_labels
    )
    if task == "causal_lm":
        # the model's own rule (model.families.next_token_targets), once here on the host
        from packed_transformers.model.families import next_token_targets

        targets = next_token_targets(torch.from_numpy(packed_labels), torch.from_numpy(rows["sequence_ids"]))
        columns["shift_labels"] = targets.numpy()
    packed = Dataset.from_dict({name: list(values) for name, values in columns.items()})
    if verbose and task == "causal_lm" and cut:
        print(
            f"{cut} examples longer than {max_sequence_length} tokens were {'split' if split_long else 'truncated'}"
        )
    if verbose:
        real = int(lengths.sum())
        print(
            f"packed {len(lengths)} examples into {len(table)} packs of {max_sequence_length} tokens "
            f"({algorithm}, K={table.shape[1]}): {real / (len(table) * max_sequence_length):.1%} real tokens, "
            f"packing factor {len(lengths) / len(table):.2f}, {time.perf_counter() - started:.1f} s"
        )
    return packed.with_format("numpy")


# What a column holds in a pack with no example: no slot in use, nothing to predict.
EMPTY_PACK_VALUE = {"example_index": -1, "labels": IGNORED, "shift_labels": IGNORED}  # any other column: 0


@dataclass
class PackedDataCollator:
    """Stacks packs into a batch of tensors: int64 everywhere, float32 multi-label labels.

    packs_per_batch: where set, a batch of fewer packs (an epoch's last, when the packs do not
    divide into batches) is filled with empty packs (example_index -1, labels -100, zeros
    elsewhere), so that every training batch has one shape: `Trainer(torch_compile=True)`
    then builds one graph for the whole run instead of a second, dynamic-shape one at the
    first short batch. Empty packs hold no example, so the loss, Trainer's
    num_items_in_batch and every metric are those of the batch without them. A batch of
    more packs (an evaluation batch size above the training one) is stacked as it is."""

    packs_per_batch: int | None = None

    def __post_init__(self):
        if self.packs_per_batch is not None:
            try:
                check_positive_int("packs_per_batch", self.packs_per_batch)
            except PackingInputError as err:
                raise PackedDatasetError(str(err)) from None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        missing = 0 if self.packs_per_batch is None else max(0, self.packs_per_batch - len(features))
        for name in features[0]:
            packs = [np.asarray(f[name]) for f in features]
            packs += [np.full_like(packs[0], EMPTY_PACK_VALUE.get(name, 0))] * missing
            stacked = np.stack(packs)
            dtype = torch.float32 if np.issubdtype(stacked.dtype, np.floating) else torch.int64
            batch[name] = torch.as_tensor(stacked, dtype=dtype)
        return batch


# ----- Trainer out -------------------------------------------------------------------------------
@dataclass
class PerExample:
    """Trainer's gathered per-slot outputs as one row per example, in input order.
    predictions: logits [n, C] (classification), start / end [n, L] (QA, -inf past a
    window's end), or a list of [L_i, C] (token classification); labels alike (None
    without labels); losses float [n] (classification, QA) or [labelled tokens]."""

    predictions: object
    labels: object = None
    losses: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    # What a Trainer user's compute_metrics reads of transformers' EvalPrediction, one row per
    # example here: `p.predictions`, `p.label_ids`, and `logits, labels = p` (or p[0], p[1]).
    @property
    def label_ids(self):
        return self.labels

    def __iter__(self):
        return iter((self.predictions, self.labels))

    def __getitem__(self, index: int):
        return (self.predictions, self.labels)[index]

    def __len__(self) -> int:
        return 2


def unpack_predictions(task: str, predictions, label_ids=None) -> PerExample:
    """Trainer's `predict()` / EvalPrediction fields from a packed model -> PerExample.

    The models output, in this order (transformers drops the keys the model config lists
    in keys_to_ignore_at_inference): classification (logits, example_loss?, example_index);
    QA (start_logits, end_logits, example_loss?, example_index, sequence_ids); tokens
    (logits, example_index, sequence_ids, token_loss?)."""
    arrays = list(predictions) if isinstance(predictions, tuple | list) else [predictions]
    if task in ("single_label_classification", "multi_label_classification"):
        logits, index = arrays[0], arrays[-1]
        n = int(index.max()) + 1
        losses = unpack_outputs(arrays[1], index, n) if len(arrays) == 3 else None
        labels = None if label_ids is None else unpack_outputs(np.asarray(label_ids), index, n)
        return PerExample(unpack_outputs(logits, index, n), labels, losses)
    if task == "question_answering":
        start, end = arrays[0], arrays[1]
        has_loss = len(arrays) == 5
        index, sequence_ids = arrays[-2], arrays[-1]
        n = int(index.max()) + 1
        cls, lengths = _slot_layout(sequence_ids, index.shape[1])
        in_order = unpack_outputs(lengths, index, n)
        start_w = unpack_token_outputs(start, cls, index, in_order)
        end_w = unpack_token_outputs(end, cls, index, in_order)
        labels = None if label_ids is None else unpack_outputs(np.asarray(label_ids), index, n)
        losses = unpack_outputs(arrays[2], index, n) if has_loss else None
        return PerExample((start_w, end_w), labels, losses)
    logits, index, sequence_ids = arrays[0], arrays[1], arrays[2]
    n = int(index.max()) + 1
    per_example, per_labels = [None] * n, [None] * n
    for pack, slots in enumerate(index):
        for slot, example in enumerate(slots):
            if example >= 0:
                tokens = sequence_ids[pack] == slot + 1
                per_example[example] = logits[pack][tokens]
                if label_ids is not None:
                    per_labels[example] = np.asarray(label_ids)[pack][tokens]
    losses = None
    if len(arrays) == 4 and label_ids is not None:
        labelled = np.asarray(label_ids) != IGNORED
        losses = arrays[3][labelled]
    return PerExample(per_example, None if label_ids is None else per_labels, losses)


def _slot_layout(sequence_ids: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(first position, tokens) of every slot [P, K] from the rows' sequence ids [P, S]."""
    own = sequence_ids[:, None, :] == np.arange(1, slots + 1)[None, :, None]  # [P, K, S]
    return own.argmax(-1), own.sum(-1)


def packed_metrics(task: str, compute_metrics=None):
    """A `compute_metrics` for Trainer: the gathered per-slot outputs become one row per
    example (`PerExample`), the user's function (if any) gets them, and "loss" is the
    exact mean over examples (tokens, for token classification) of their own losses.
    Trainer writes it as eval_loss in place of its mean of per-batch means, which
    weighs batches, not examples."""

    def metrics(eval_prediction) -> dict:
        rows = unpack_predictions(task, eval_prediction.predictions, eval_prediction.label_ids)
        out = dict(compute_metrics(rows)) if compute_metrics is not None else {}
        if rows.losses is not None and rows.losses.size:
            out["loss"] = float(np.mean(rows.losses, dtype=np.float64))
        return out

    return metrics
