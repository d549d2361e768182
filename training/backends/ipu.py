"""Graphcore IPU backend (PopTorch). The only module that imports poptorch.

Status: only the availability check exists; the pipelined/replicated PopTorch training
path is open work (issue 7). Selecting an IPU never falls back to another device.
"""

from __future__ import annotations

from training.build import RunError


def require_poptorch():
    try:
        import poptorch  # noqa: F401
    except ImportError:
        raise RunError(
            "execution.device ipu/ipu-model needs poptorch, which is not installed: install the poptorch "
            "wheel shipped with Graphcore's Poplar SDK (pip install <sdk>/poptorch-*.whl) and enable the SDK"
        ) from None
    return poptorch


def run_ipu(config: dict, output, resume: bool) -> int:
    require_poptorch()
    raise RunError("the IPU training path is not implemented in this version (see the README's status table)")
