import sys

from packed_transformers.packing.cli import main

sys.exit(main())
