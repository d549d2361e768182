import sys

from packing.cli import main

sys.exit(main())
