"""`python run_pretraining.py --config ...` from a checkout, and torchrun's script: the same
command as `packed pretrain` (packed_transformers/run_pretraining.py)."""

import sys

from packed_transformers.run_pretraining import main

if __name__ == "__main__":
    sys.exit(main())
