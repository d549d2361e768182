"""The limits every input is held to, written once; each reader imports its limit from here.

| limit | value | where it is checked |
|---|---|---|
| MAX_FIELD_CHARS | 1,000,000 characters | a text field (data.text_rule.check_text) |
| MAX_LINE_BYTES | 13,048,576 bytes | a line of a JSON-lines input (data.classification_data.bounded_lines) |
| MAX_SEQUENCE_LENGTH | 1,048,576 tokens | a row or pack length (packs.histogram.check_sequence_length) |
| MAX_INT_DIGITS | 4,300 digits | an integer in JSON (common.json_text.loads) or YAML (common.config_schema) |
| MAX_MODEL_WIDTH, MAX_MODEL_LAYERS, MAX_MODEL_HEADS | 65,536 / 1,024 / 1,024 | a decoder config's shape (training.decoder.config) |
| MAX_PLAN_GPUS, MAX_GPU_MEMORY_GIB | 1,000,000 / 1,000,000 | the memory plan's --gpus, --gpu-memory-gib (run_pretraining.py) |
"""

from __future__ import annotations

import sys

# The longest text field: a million characters, far past any model's context.
MAX_FIELD_CHARS = 1_000_000

# The longest line read: a text of MAX_FIELD_CHARS characters written as JSON escapes
# (`\uXXXX` pairs: 12 bytes a character at worst) and room for other fields. A file object's
# own iteration reads a line whole however long it is: an input with no newline (/dev/zero)
# is one endless line, and the process grew until the OOM killer ended it.
MAX_LINE_BYTES = 12 * MAX_FIELD_CHARS + (1 << 20)

# The longest row any packer or pack reader takes: 1 M tokens (128x Llama 3.1's 8,192). A
# histogram, a plan and every [rows, S] array are sized by it before any data is read, so a
# larger value is a typo (1e9) that would ask for gigabytes, refused where it is given.
MAX_SEQUENCE_LENGTH = 1 << 20

# The most digits an integer may have: Python's own limit on int <-> str conversion (which
# raises a bare ValueError past it), said in our words where a JSON line, a request body, a
# config or --set holds a longer one. No setting here needs more than a handful.
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300

# A model's shape, far past any model trained (Llama 3.1 405B: width 16,384, MLP 53,248, 126
# layers, 128 heads): the memory plan builds the model on fake tensors layer by layer, and a
# typo (num_hidden_layers=1000000) ran for minutes and grew past 900 MB before any line.
MAX_MODEL_WIDTH = 1 << 16  # hidden_size
MAX_MODEL_MLP_WIDTH = 1 << 18  # intermediate_size
MAX_MODEL_LAYERS = 1024
MAX_MODEL_HEADS = 1024

# The memory plan's machine: a million GPUs of a million GiB each; inf and NaN are not sizes.
MAX_PLAN_GPUS = 1_000_000
MAX_GPU_MEMORY_GIB = 1_000_000.0
