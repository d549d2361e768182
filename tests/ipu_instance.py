"""One poprun instance for tests/training/test_ipu_double.py: the IPU engine on the doubles in
tests/doubles (PYTHONPATH puts them first), with a validated config from a JSON file.

    python -m tests.ipu_instance CONFIG.json OUTPUT_DIR [--resume]     (exit code: the run's)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import poptorch

from packed_transformers.engines.ipu import IpuEngine
from packed_transformers.training.run import run_training

if __name__ == "__main__":
    assert "doubles" in poptorch.__file__, "the double, never a real poptorch"
    config = json.loads(Path(sys.argv[1]).read_text())
    resume = sys.argv[3:] == ["--resume"]
    sys.exit(run_training(config, Path(sys.argv[2]), resume=resume, engine_class=IpuEngine))
