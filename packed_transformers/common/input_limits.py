"""The limits every input is held to, written once; each reader imports its limit from here.

| limit | value | where it is checked |
|---|---|---|
| MAX_FIELD_CHARS | 1,000,000 characters | a text field (data.text_rule.check_text) |
| MAX_LINE_BYTES | 13,048,576 bytes | a line of a JSON-lines input (data.classification_data.bounded_lines) |
| MAX_SEQUENCE_LENGTH | 1,048,576 tokens | a row or pack length (packs.histogram.check_sequence_length) |
| MAX_INT_DIGITS | 4,300 digits | an integer in JSON (common.json_text.loads) or YAML (common.config_schema) |
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
