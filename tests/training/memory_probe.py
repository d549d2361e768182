"""The peak memory of decoder pretraining's real steps, for tests/training/test_memory_plan.py:
`python tests/training/memory_probe.py CONFIG.json OUTPUT` builds the run as
run_pretraining.py does (training.decoder.run.DecoderRun: the model, AdamW, the rows), runs
two of its steps (the second with AdamW's state, as every later one) and prints
{"peak_bytes": the bytes the run's tensors reached}: the process's peak resident memory over
what it held once the run was built, plus the bytes of the tensors the run held then (its
weights). What building the run added besides tensors (modules transformers imports lazily,
the rows' index) is not the run's tensors and is left out that way. Started with
MALLOC_MMAP_THRESHOLD_=65536, so that glibc maps every tensor of 64 KiB or more on its own and
gives it back when freed: the resident peak (VmHWM) is then the live peak."""

import json
import sys
from pathlib import Path

import psutil

from packed_transformers.training.decoder.config import validate
from packed_transformers.training.decoder.run import DecoderRun

config = validate(json.loads(Path(sys.argv[1]).read_text()))
run = DecoderRun(config, Path(sys.argv[2]), resume=False)
built = psutil.Process().memory_info().rss
held = {
    id(t.untyped_storage()): t.untyped_storage().nbytes()
    for t in [*run.model.parameters(), *run.model.buffers()]
}
for _ in range(2):
    run._step()
# VmHWM: this process's own resident peak. ru_maxrss is not: Linux keeps the larger of it and
# the peak of the process that forked this one (a pytest worker of 2 GB) across the exec.
status = dict(
    line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
)
peak = int(status["VmHWM"].split()[0]) * 1024  # kB
print(json.dumps({"peak_bytes": peak - built + sum(held.values())}))
