"""What a refusal tells a user to install, as a command they can run in the install they have (a
clone, a pip install outside one, the light install): `pip install` with exact pins, never a
requirements file or a make target alone (a pip user has neither). The pins are those of
requirements*.txt, the versions `make test` tests (tests/house/test_advice.py holds them equal).
"""

from __future__ import annotations

# the import name a command looks for -> the pip argument that installs the tested version
PIP_PINS: dict[str, str] = {
    "numpy": "numpy==2.4.6",
    "tokenizers": "tokenizers==0.23.3",
    "onnxruntime": "onnxruntime==1.32.0",
    "openvino": "openvino==2026.4.1",
    "nncf": "nncf==3.4.0",
    "tensorflow": "tensorflow-cpu==2.21.0",
    "ray": "'ray[data]==2.60.0'",
}


def pip_install(*names: str) -> str:
    """`pip install` of the import names' pinned packages, e.g. pip_install("openvino")."""
    return "pip install " + " ".join(PIP_PINS[name] for name in names)
