import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
HISTOGRAMS = REPO / "packing" / "histograms"

# Property tests: reproducible by default ("ci": the same examples every run, no deadline
# on a loaded 2-core machine); HYPOTHESIS_PROFILE=explore draws new examples each run.
# Each test's own @settings(max_examples=...) bounds its run time.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO
