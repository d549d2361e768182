"""Every refusal's advice is one a user can follow in their install (issue 110 item 4): the
`pip install` lines name the pins `make test` tests, a make target or requirements file is
advised only for a clone (a pip user has neither), and every `packed SUBCOMMAND --option` the
package's messages and docstrings advise exists (`packed SUBCOMMAND --help` lists it).

The advice found by reading the package's source: a new message that advises anything is held
to the same rules without a test of its own."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ..conftest import REPO

PACKAGE = REPO / "packed_transformers"


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def requirement_pins() -> dict[str, str]:
    """{package name, lower case, extras dropped: version} of every requirements*.txt."""
    pins = {}
    for path in REPO.glob("requirements*.txt"):
        if path.name in ("requirements-ipu.txt", "requirements-peers.txt", "requirements-peers-nodeps.txt"):
            continue  # PopTorch 3.4's stack (torch 2.0.1); the bench's OpenVINO peer: environments of their own
        for line in path.read_text().splitlines():
            match = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#;]+)", line)
            if match:
                pins[match.group(1).lower()] = match.group(3)
    return pins


def test_the_advice_table_pins_what_make_test_tests():
    from packed_transformers.common.install_advice import PIP_PINS

    pins = requirement_pins()
    for name, argument in PIP_PINS.items():
        package, version = re.fullmatch(r"'?([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^']+)'?", argument).groups()
        assert pins.get(package.lower()) == version, (name, argument, pins.get(package.lower()))


def test_every_pinned_pip_install_in_the_package_names_a_tested_version():
    pins = requirement_pins()
    advised = []
    for path, text in package_sources().items():
        for line in re.findall(r"pip install[^\n]*", text):
            # the project's extras resolve against an index it is not on: the packages themselves
            assert "packed-transformers[" not in line, (path, line)
            for package, version in re.findall(
                r"([A-Za-z][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?==([0-9][^\s'\"`;),]*)", line
            ):
                advised.append((path, package, version))
                if (
                    package.lower() in pins
                ):  # the CUDA wheel's torch, an IPU SDK's: pinned where they are advised
                    assert pins[package.lower()] == version, (path, line)
    # the scan finds the advice written out (the CUDA wheel's line, Ray's option group); the rest is
    # common.install_advice's table, held by the test above
    assert {package for _, package, _ in advised} >= {"torch", "ray"}, advised


def test_requirement_files_and_make_targets_are_advised_for_a_clone_only():
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    found = []
    for path, text in package_sources().items():
        for match in re.finditer(r"pip install -r \S+|\bmake ([a-z][\w-]*)", text):
            before = text[max(0, match.start() - 60) : match.start()]
            if match.group(0).startswith("make") and match.group(1) not in targets:
                # prose ("make them agree"), not a target
                continue
            found.append((path, match.group(0)))
            # a docstring for developers may name the file; a message a user reads says where it applies
            in_docstring = text.count('"""', 0, match.start()) % 2 == 1
            assert in_docstring or "clone" in before, (path, match.group(0), before)
    assert found, "the scan finds the clone-only advice"


# `packed SUB` and what follows it on its line up to a quote, backtick, parenthesis or semicolon
ADVISED = re.compile(r"\bpacked ([a-z][a-z-]+)((?:[ \t]+[^\s`'\"();,][^\s`'\"();,]*)*)")


def advised_options() -> dict[str, set[str]]:
    """{subcommand: {--option, ...}} of every `packed SUB ...` line in the package's source."""
    from packed_transformers.commands.packed import SUBCOMMANDS

    advised: dict[str, set[str]] = {}
    for text in package_sources().values():
        for match in ADVISED.finditer(text):
            sub = match.group(1)
            if sub not in SUBCOMMANDS:
                continue  # prose: "packed rows", "packed rerank's"
            advised.setdefault(sub, set()).update(re.findall(r"(?<![^\s\[])(--[a-z][\w-]*)", match.group(2)))
    return advised


def test_the_scan_finds_the_advised_commands():
    advised = advised_options()
    assert {"export", "train", "embed", "predict"} <= set(advised), advised
    assert {"--runtime", "--dtype"} <= advised["export"], advised["export"]


@pytest.mark.parametrize(
    "sub", sorted(sub for sub, options in advised_options().items() if options - {"--help"})
)
def test_every_advised_option_exists(sub):
    options = advised_options()[sub] - {"--help"}
    done = subprocess.run([sys.executable, "-m", "packed_transformers", sub, "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    listed = set(re.findall(r"(--[a-z][\w-]*)", done.stdout))
    assert options <= listed, (sub, sorted(options - listed))
