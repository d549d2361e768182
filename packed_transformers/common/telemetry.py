"""Nothing leaves the machine unasked: the usage telemetry of the libraries the project runs,
declined before they start.

OpenVINO's Python tools (`openvino.convert_model`, NNCF) report usage to Google Analytics
through the `openvino_telemetry` package, on by default: child processes that POST events,
a client id and counters written under `~/intel/`. Its documented opt-out (`opt_in_out
--opt_out`) writes the answer into `~/intel/openvino_telemetry`, a file in the user's home
the project has no business writing. Every OpenVINO tool asks one place whether to send:
`openvino_telemetry`'s consent check (`OptInChecker.check`). `decline_openvino_telemetry`
makes that check answer "declined" in this process, before openvino is first imported:
no event is sent, no sender process started, nothing written under `~/intel`.

    PACKED_TRANSFORMERS_OPENVINO_TELEMETRY=1     leave OpenVINO's own consent rules in force
                                                 (its consent file, `opt_in_out --opt_in`)

ONNX Runtime (1.32's Linux wheel too, whatever its privacy notice says of Windows) keeps a device
id and an event store under `~/.cache/Microsoft/DeveloperTools/.onnxruntime/` and sends the
events to Microsoft's collector (mobile.events.data.microsoft.com), unless `ORT_DISABLE_TELEMETRY`
is set (its own switch, read when it loads; children inherit it). `decline_onnxruntime_telemetry`
sets it before onnxruntime is imported, unless the user set it or asked for telemetry:

    PACKED_TRANSFORMERS_ONNXRUNTIME_TELEMETRY=1  leave ONNX Runtime's default (telemetry on)

Standard library only.
"""

from __future__ import annotations

import os

OPENVINO_TELEMETRY_VARIABLE = "PACKED_TRANSFORMERS_OPENVINO_TELEMETRY"
ONNXRUNTIME_TELEMETRY_VARIABLE = "PACKED_TRANSFORMERS_ONNXRUNTIME_TELEMETRY"


def decline_onnxruntime_telemetry() -> bool:
    """ORT_DISABLE_TELEMETRY=1 in this process's environment (so in its children's too), unless
    the user set ORT_DISABLE_TELEMETRY or asked for telemetry. -> whether it is declined."""
    if os.environ.get(ONNXRUNTIME_TELEMETRY_VARIABLE) == "1":
        return False
    return os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1") == "1"


def decline_openvino_telemetry() -> bool:
    """Make openvino_telemetry's consent check answer DECLINED in this process (unless the
    user asked for telemetry). -> whether it is declined (False: asked for, or the package
    is not installed, so there is nothing to send with)."""
    if os.environ.get(OPENVINO_TELEMETRY_VARIABLE) == "1":
        return False
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:
        return False

    def declined(self, enable_opt_in_dialog=True, disable_in_ci=False):
        return ConsentCheckResult.DECLINED

    OptInChecker.check = declined
    return True
