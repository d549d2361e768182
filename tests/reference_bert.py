"""google-research/bert's own data generator, the judge of data.create_pretraining_data.

bert-tensorflow 1.0.4 (PyPI) is google-research/bert's code without whole-word masking: its
`create_pretraining_data.py` draws random numbers line for line as MLPerf's copy in
mlcommons/training `language_model/tensorflow/bert/cleanup_scripts/` does, and its tokenizer is
the same but for a `preserve_unused_tokens` flag, left at its default False (the original
behaviour: "[unused0]" in text is tokenized as text). They import
TensorFlow (`import tensorflow.compat.v1 as tf`) for three things only, which
`_tensorflow_stand_in` provides:
- `tf.flags` at import: tf.compat.v1.flags is absl's flags module (tensorflow/python/platform/flags.py).
- `tf.gfile.GFile(path, "r")` with `readline()`: lines split at "\\n" only. Opened in binary
  here and decoded by the reference's own `convert_to_unicode` (UTF-8).
- `tf.logging`, on paths the tests do not call.
The real TensorFlow is never needed, and sys.modules is restored after the import.
"""

from __future__ import annotations

import functools
import glob
import importlib
import random
import sys
import types

import numpy as np


def _tensorflow_stand_in():
    from absl import flags

    v1 = types.ModuleType("tensorflow.compat.v1")
    v1.flags = flags
    v1.gfile = types.SimpleNamespace(GFile=lambda path, mode="r": open(path, "rb"), Glob=glob.glob)
    v1.logging = types.SimpleNamespace(info=lambda *a, **k: None, set_verbosity=lambda *a: None, INFO=20)
    compat = types.ModuleType("tensorflow.compat")
    compat.v1 = v1
    tf = types.ModuleType("tensorflow")
    tf.compat = compat
    tf.__path__ = []  # a package, so that `import tensorflow.compat.v1` resolves
    return {"tensorflow": tf, "tensorflow.compat": compat, "tensorflow.compat.v1": v1}


def load():
    """-> (create_pretraining_data module, tokenization module) of the reference."""
    if "bert.create_pretraining_data" not in sys.modules:
        stand_in = _tensorflow_stand_in()
        saved = {name: sys.modules.get(name) for name in stand_in}
        sys.modules.update(stand_in)
        try:
            importlib.import_module("bert.tokenization")
            importlib.import_module("bert.create_pretraining_data")
            from absl import flags

            if not flags.FLAGS.is_parsed():
                flags.FLAGS(["reference"])  # every flag at its default
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return sys.modules["bert.create_pretraining_data"], sys.modules["bert.tokenization"]


def reference_arrays(files, vocab_file, seed, s, p, dupe_factor, masked_lm_prob=0.15, short_seq_prob=0.1):
    """The reference's instances as the six MLPerf fields, as its write_instance_to_example_files
    lays them out (ids padded with 0 to S and P; next_sentence_labels 1 for random next)."""
    cpd, tokenization = load()
    tokenizer = tokenization.FullTokenizer(vocab_file=str(vocab_file), do_lower_case=True)
    instances = cpd.create_training_instances(
        [str(f) for f in files],
        tokenizer,
        s,
        dupe_factor,
        short_seq_prob,
        masked_lm_prob,
        p,
        random.Random(seed),
    )
    n = len(instances)
    out = {
        "input_ids": np.zeros((n, s), np.int64),
        "input_mask": np.zeros((n, s), np.int64),
        "segment_ids": np.zeros((n, s), np.int64),
        "masked_lm_positions": np.zeros((n, p), np.int64),
        "masked_lm_ids": np.zeros((n, p), np.int64),
        "next_sentence_labels": np.zeros(n, np.int64),
    }
    for row, inst in enumerate(instances):
        ids = tokenizer.convert_tokens_to_ids(inst.tokens)
        out["input_ids"][row, : len(ids)] = ids
        out["input_mask"][row, : len(ids)] = 1
        out["segment_ids"][row, : len(ids)] = inst.segment_ids
        labels = tokenizer.convert_tokens_to_ids(inst.masked_lm_labels)
        out["masked_lm_positions"][row, : len(labels)] = inst.masked_lm_positions
        out["masked_lm_ids"][row, : len(labels)] = labels
        out["next_sentence_labels"][row] = int(inst.is_random_next)
    return out


@functools.lru_cache(maxsize=4)
def full_tokenizer(vocab_file: str):
    """The reference's FullTokenizer of `vocab_file` (built once: it reads 30k vocabulary lines)."""
    _, tokenization = load()
    return tokenization.FullTokenizer(vocab_file=vocab_file, do_lower_case=True)


def reference_tokenize(vocab_file, lines):
    """The reference FullTokenizer's ids for each line."""
    tokenizer = full_tokenizer(str(vocab_file))
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(line)) for line in lines]
