import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HISTOGRAMS = REPO / "packing" / "histograms"

# Keep the property tests' run time bounded and reproducible in CI.
os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
