"""`finetune.train` with every gather of whole weights counted (tests only): each rank runs the
command's `main` with components.replicas.gathered_weights wrapped, then writes how many times
it was called to GATHER_COUNTS/rank-<r>.txt. A test double around our own function, so that a
run under torchrun can say how often its ranks gathered the model whole (each gather is a
collective moving every weight to rank 0's host memory).

    python -m torch.distributed.run ... -m tests.finetune.counted_gathers --config ... --output-dir ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    from packed_transformers.components import replicas

    calls = []
    gather = replicas.gathered_weights

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    replicas.gathered_weights = counted  # read from the module at each call (finetune.train, torch_engine)
    from packed_transformers.finetune import train

    code = train.main(sys.argv[1:])
    folder = Path(os.environ["GATHER_COUNTS"])
    (folder / f"rank-{os.environ.get('RANK', '0')}.txt").write_text(str(len(calls)))
    return code


if __name__ == "__main__":
    sys.exit(main())
