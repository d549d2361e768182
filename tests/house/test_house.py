"""The house (ARCHITECTURE.md section 6): rooms by role, floors with arrows only downward,
each room's nevers, room sizes, one opener for every run, config.json read once, the length
limit computed once. Static checks read every import statement and call of the product
code (function-level ones included); each check is shown to fail on a planted breach."""

from __future__ import annotations

import ast
import json
import os

import pytest

from ..conftest import PACKAGE, REPO
from ..house_helpers import PRODUCT_PACKAGES, config_reads, import_circles, import_graph

# Floors, bottom first: a module imports only its own floor or those below it.
FLOORS = (
    ("common",),
    ("packs",),
    ("packing",),
    ("data",),
    ("model", "optim"),
    ("components",),
    ("engines",),
    ("training",),
    ("door",),
    ("inference",),
    ("finetune", "ray_jobs", "hf_integration"),
    ("serving",),
    ("commands",),
)
FLOOR_OF = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}

# room -> rooms it never imports (beyond the floors' rule: rooms on its own floor, and what
# its __init__.py promises)
NEVERS = {
    "door": ("inference", "finetune", "ray_jobs", "hf_integration", "serving", "commands", "training"),
    "inference": ("finetune", "ray_jobs", "hf_integration", "serving", "commands", "training"),
    # finetune runs data.task rerank as sentence-transformers' trainer (hf_integration/rerank_train.py)
    "finetune": ("training", "serving", "ray_jobs", "commands"),
    "ray_jobs": ("finetune", "serving", "commands", "training", "hf_integration"),
    "hf_integration": ("finetune", "ray_jobs", "serving", "commands", "training"),
    "serving": ("finetune", "training", "ray_jobs", "hf_integration", "commands"),
    "training": ("door", "inference", "finetune", "serving", "ray_jobs", "hf_integration", "commands"),
    "components": ("training", "door", "inference", "finetune", "serving", "ray_jobs", "hf_integration"),
    "engines": ("training", "door", "inference", "finetune", "serving", "ray_jobs", "hf_integration"),
    "model": ("packs", "packing", "components", "training", "data", "door", "inference", "finetune"),
}


def room_edges(graph: dict[str, set[str]]) -> set[tuple[str, str, str, str]]:
    """(room, target room, module, target module) for every import across rooms."""
    return {
        (a.split(".")[0], b.split(".")[0], a, b)
        for a, targets in graph.items()
        for b in targets
        if a.split(".")[0] != b.split(".")[0]
    }


def upward(graph) -> list[str]:
    return sorted(
        f"{a} -> {b}" for room, target, a, b in room_edges(graph) if FLOOR_OF[target] > FLOOR_OF[room]
    )


def broken_nevers(graph) -> list[str]:
    return sorted(f"{a} -> {b}" for room, target, a, b in room_edges(graph) if target in NEVERS.get(room, ()))


def test_every_product_room_has_a_floor_and_a_contract():
    rooms = {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name in PRODUCT_PACKAGES
    }
    assert rooms == set(FLOOR_OF) == set(PRODUCT_PACKAGES)
    for room in rooms:
        contract = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())) or ""
        assert "never" in contract.lower(), f"{room}/__init__.py states no never"


def test_no_import_goes_up_a_floor_or_breaks_a_never():
    graph = import_graph()
    assert upward(graph) == []
    assert broken_nevers(graph) == []
    assert import_circles(graph) == []
    # the checks can fail: a planted function-level import from the door into inference
    planted = {**graph, "door.opener": graph["door.opener"] | {"inference.runner"}}
    assert upward(planted) == ["door.opener -> inference.runner"]
    assert "door.opener -> inference.runner" in broken_nevers(planted)


def test_ray_lives_in_its_room_only():
    outside = []
    for room in PRODUCT_PACKAGES:
        if room == "ray_jobs":
            continue
        for path in (PACKAGE / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "ray" or n.startswith("ray.") for n in names):
                    outside.append(str(path.relative_to(PACKAGE)))
    assert outside == []


def modules_and_lines(room: str, package=PACKAGE) -> tuple[int, int]:
    """Python files anywhere under the room (its sub-folders' too) and their lines: a folder
    inside a room is part of its size, not a way around the rule."""
    files = sorted((package / room).rglob("*.py"))
    return len(files), sum(len(f.read_text().splitlines()) for f in files)


def test_rooms_stay_small(tmp_path):
    modules, lines = modules_and_lines("finetune")
    assert modules <= 16 and lines <= 2000, (modules, lines)
    sizes = {room: modules_and_lines(room)[0] for room in PRODUCT_PACKAGES}
    assert {room: n for room, n in sizes.items() if n > 20} == {}
    # the rule sees files in sub-folders: 19 top-level modules and two in a sub-folder are 21
    (tmp_path / "room" / "sub").mkdir(parents=True)
    for i in range(19):
        (tmp_path / "room" / f"m{i}.py").write_text("")
    for name in ("__init__.py", "deep.py"):
        (tmp_path / "room" / "sub" / name).write_text("")
    assert modules_and_lines("room", tmp_path)[0] == 21


# ----- one opener ---------------------------------------------------------------------------------
# Calls that open a model folder; only the door (and model/, the builders it calls) makes them.
OPENING_CALLS = {"open_model", "load_finetuned", "load_encoder", "open_packed_model", "open_checkpoint"}
PACKED_HEADS = {"PackedBertForSequenceClassification", "PackedBertForQuestionAnswering",
                "PackedBertForTokenClassification", "PackedBertForEmbedding", "PackedFamilyModel",
                "PackedCausalLM", "SequenceClassifierForInference", "TokenClassifierForInference",
                "QuestionAnsweringForInference"}  # fmt: skip
# Pretraining opens its own checkpoints (a PackedBertForPreTraining, never a LoadedModel).
OPENERS_ALLOWED = ("door", "model", "training")


def opening_calls(source: str) -> list[str]:
    """Calls in `source` that open a model folder other than through door.opener.open_folder."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in OPENING_CALLS:
            found.append(func.id)
        elif isinstance(func, ast.Attribute):
            if func.attr in OPENING_CALLS:
                found.append(func.attr)
            elif (
                func.attr == "from_pretrained"
                and isinstance(func.value, ast.Name)
                and func.value.id in PACKED_HEADS
            ):
                found.append(f"{func.value.id}.from_pretrained")
    return found


def test_one_function_opens_a_model_folder():
    callers = {}
    for room in PRODUCT_PACKAGES:
        if room in OPENERS_ALLOWED:
            continue
        for path in (PACKAGE / room).rglob("*.py"):
            calls = opening_calls(path.read_text())
            if calls:
                callers[str(path.relative_to(PACKAGE))] = calls
    assert callers == {}
    assert opening_calls(
        "from packed_transformers.model.opening import open_model\nopen_model(f, 'classification')"
    ) == ["open_model"]
    assert opening_calls("PackedFamilyModel.from_pretrained(f, 'embedding')") == [
        "PackedFamilyModel.from_pretrained"
    ]


def test_the_length_limit_is_computed_in_the_door_only():
    """No `max_tokens(` (the positions a model's table holds) after the door and no decision
    on FolderSpec.source: LoadedModel.max_length is the limit. (hf_integration.pipeline
    computes it for a model object handed in without a folder, where there is no door.)"""
    found = []
    for room in ("inference", "finetune", "serving", "ray_jobs", "hf_integration", "commands"):
        for path in (PACKAGE / room).rglob("*.py"):
            text = path.read_text()
            for number, line in enumerate(text.splitlines(), 1):
                code = line.split("#")[0]
                if ("max_tokens(" in code or "spec.source" in code) and "def " not in code:
                    found.append(f"{path.relative_to(PACKAGE)}:{number}")
    assert found == ["hf_integration/pipeline.py:" + str(pipeline_line())], found


def pipeline_line() -> int:
    lines = (REPO / "packed_transformers" / "hf_integration" / "pipeline.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "max_tokens(self.model.config)" in line)


# ----- config.json read once on every way in ---------------------------------------------------------
def test_predict_and_embed_read_config_json_once(hub_classifier, tmp_path):
    from packed_transformers.commands import embed, predict

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("a text", "another text here")))

    def run_predict():
        assert (
            predict.main(
                [
                    "--model",
                    str(hub_classifier),
                    "--input",
                    str(source),
                    "--output",
                    str(tmp_path / "p.jsonl"),
                ]
            )
            == 0
        )

    def run_embed():
        argv = ["--model", str(hub_classifier), "--input", str(source), "--output", str(tmp_path / "e.npy"),
                "--pooling", "mean", "--quiet"]  # fmt: skip
        assert embed.main(argv) == 0

    assert config_reads(run_predict, hub_classifier) == 1
    assert config_reads(run_embed, hub_classifier) == 1


@pytest.mark.slow  # a whole fine-tuning run
def test_fine_tuning_from_a_checkpoint_reads_its_config_json_once(hub_classifier, tmp_path):
    import shutil

    from packed_transformers.door.folder_spec import read_json_object
    from packed_transformers.finetune import train

    from ..finetune_helpers import write_config

    checkpoint = tmp_path / "checkpoint"  # a transformers folder with its own tokenizer
    shutil.copytree(hub_classifier, checkpoint)
    path = write_config(tmp_path, checkpoint, training={"epochs": 1, "progress": False})

    def fine_tune(extra=lambda: None):
        def run():
            assert (
                train.main(["--config", str(path), "--output-dir", str(tmp_path / "run"), "--overwrite"]) == 0
            )
            extra()

        return run

    assert config_reads(fine_tune(), checkpoint) == 1
    # the count can fail: a planted second reader is seen
    assert config_reads(fine_tune(lambda: read_json_object(checkpoint / "config.json")), checkpoint) == 2


# ----- one command, a real package ---------------------------------------------------------------
def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[name.split("[")[0].strip().lower()] = version.strip()
    return out


def test_the_package_pins_what_requirements_pin():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = (
        pins(project["dependencies"])
        | pins(extras["test"])
        | pins(extras["openvino"])
        | pins(extras["onnxruntime"])
    )
    required = pins((REPO / "requirements.txt").read_text().splitlines())
    assert declared == required
    assert pins(project["optional-dependencies"]["ray"]) == pins(
        (REPO / "requirements-ray.txt").read_text().splitlines()
    )
    assert pins(project["optional-dependencies"]["bench"]) == pins(
        (REPO / "requirements-bench.txt").read_text().splitlines()
    )
    assert project["scripts"] == {"packed": "packed_transformers.commands.packed:main"}


def test_packed_names_every_job_and_runs_its_module(capsys):
    import importlib.util

    from packed_transformers.commands import packed

    assert packed.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for job in ("pack", "verify", "pretrain", "train", "predict", "embed", "serve", "gather", "report"):
        assert f"  {job} " in listed
    for sub in packed.SUBCOMMANDS.values():
        assert importlib.util.find_spec(f"packed_transformers.{sub.module}") is not None, sub.module
    assert packed.main(["predcit"]) == 2
    assert "did you mean 'predict'?" in capsys.readouterr().err


@pytest.mark.slow  # the subcommands in fresh interpreters
def test_packed_subcommands_answer_as_their_modules(tmp_path):
    import subprocess
    import sys

    for argv, module_argv in (
        (["predict", "--model", str(tmp_path / "none"), "--input", "x", "--output", "y"],
         ["packed_transformers.finetune.predict", "--model", str(tmp_path / "none"), "--input", "x", "--output", "y"]),
        (["pack", "--help"], ["packed_transformers.packing", "pack", "--help"]),
    ):  # fmt: skip
        ours = subprocess.run(
            [sys.executable, "-m", "packed_transformers.commands.packed", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        theirs = subprocess.run(
            [sys.executable, "-m", *module_argv], cwd=REPO, capture_output=True, text=True
        )
        assert ours.returncode == theirs.returncode and ours.stderr == theirs.stderr
        # the same help after the usage block, whose program name is the one the user typed
        assert ours.stdout.split("\n\n", 1)[1:] == theirs.stdout.split("\n\n", 1)[1:]


@pytest.mark.slow  # builds the wheel (setuptools from the package index)
def test_the_wheel_installs_one_name_holding_every_room_the_command_and_the_histograms(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "source"  # a copy: setuptools stages its build/ beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "runs", "demo_out", "demo_qa", "work", "build", "*.egg-info", "__pycache__"))  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path)],
                   check=True, capture_output=True)  # fmt: skip
    wheel = next(tmp_path.glob("packed_transformers-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"packed_transformers"}, top_level  # one name in site-packages
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt")) if any(
        n.endswith("top_level.txt") for n in names) else None  # fmt: skip
    if info:
        assert zipfile.ZipFile(wheel).read(info).decode().split() == ["packed_transformers"]
    for room in PRODUCT_PACKAGES:
        assert f"packed_transformers/{room}/__init__.py" in names, room
    for inner in ("training/decoder", "packs/lm_rows"):  # the rooms' own subfolders
        assert f"packed_transformers/{inner}/__init__.py" in names, inner
    assert "packed_transformers/run_pretraining.py" in names
    assert "packed_transformers/packing/histograms/wikipedia_512.json" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "packed = packed_transformers.commands.packed:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # the check can fail: a second top-level package in the source is a second name in the wheel
    (source / "pyproject.toml").write_text((source / "pyproject.toml").read_text().replace(
        'include = ["packed_transformers", "packed_transformers.*"]',
        'include = ["packed_transformers", "packed_transformers.*", "tests"]'))  # fmt: skip
    planted = tmp_path / "planted"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(planted)],
                   check=True, capture_output=True)  # fmt: skip
    names = zipfile.ZipFile(next(planted.glob("*.whl"))).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info" not in n} == {"packed_transformers", "tests"}


def test_a_process_left_behind_by_a_command_is_killed_and_reported():
    """tests/processes.py: what the launcher leaves running in its group fails the test (the
    torchrun rank found 50 minutes after the suite), and is killed."""
    import subprocess
    import sys
    import time

    from ..processes import Hung, LeftBehind, run_in_group

    marker = "import time; time.sleep(300)  # left-behind-probe"
    launcher = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {marker!r}])"
    with pytest.raises(LeftBehind, match="outlived it"):
        run_in_group([sys.executable, "-c", launcher], timeout=60)
    time.sleep(0.5)
    alive = subprocess.run(
        ["pgrep", "-f", "left-behind-probe"], capture_output=True, text=True
    ).stdout.split()
    assert alive == []
    assert run_in_group([sys.executable, "-c", "print('fine')"], timeout=60).stdout == "fine\n"
    # a hang is reported with the stack it hung in (faulthandler on SIGABRT), then killed
    hang = "import time\ndef waits_forever():\n    time.sleep(30)\nwaits_forever()"
    with pytest.raises(Hung, match=r"(?s)ran past 1 s.*in waits_forever"):
        run_in_group([sys.executable, "-c", hang], timeout=1)
    # a process started in a session of its own, as torchrun starts its ranks: found by the
    # tag it inherited, killed and reported when left behind; its stack shown when it hangs
    session_marker = "import time; time.sleep(300)  # own-session-probe"
    own_session = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {session_marker!r}], "
                   "start_new_session=True)")  # fmt: skip
    with pytest.raises(LeftBehind, match="outlived it"):
        run_in_group([sys.executable, "-c", own_session], timeout=60)
    time.sleep(0.5)
    assert subprocess.run(["pgrep", "-f", "own-session-probe"], capture_output=True, text=True).stdout == ""
    rank = "import time\ndef rank_waits():\n    time.sleep(300)\nrank_waits()"
    launcher = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)"
                ".wait()")  # fmt: skip
    with pytest.raises(Hung, match=r"(?s)ran past 4 s.*in rank_waits"):  # 4 s: two interpreters started
        run_in_group([sys.executable, "-c", launcher], timeout=4)
    time.sleep(0.5)
    assert subprocess.run(["pgrep", "-f", "def rank_waits"], capture_output=True, text=True).stdout == ""


def documented_imports() -> list[str]:
    """Every `from packed_transformers... import ...` line of the README's and docs' Python
    blocks (the names a user copies)."""
    import re

    lines = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
            lines += [
                line.strip()
                for line in block.splitlines()
                if line.strip().startswith("from packed_transformers")
            ]
    return sorted(set(lines))


@pytest.mark.slow  # fresh interpreters in a user's folder
def test_a_users_own_data_model_and_common_beside_their_script_change_nothing(tmp_path):
    """The documented imports and `python -m packed_transformers` run from a folder holding a
    user's own data/, model.py, common.py and training/ (which refuse to be imported): both as a
    script in that folder and as `python -c` with that folder first on the path."""
    import subprocess
    import sys

    imports = documented_imports()
    assert len(imports) >= 3, imports  # the README's Trainer block at least
    for name in ("data/__init__.py", "model.py", "common.py", "training/__init__.py", "optim.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    script = tmp_path / "train.py"
    script.write_text("\n".join(imports) + "\nprint('imported', len(" + repr(imports) + "))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert ran.returncode == 0 and ran.stdout.startswith("imported"), ran.stderr[-2000:]
    helped = subprocess.run([sys.executable, "-m", "packed_transformers", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, env=env)  # fmt: skip
    assert helped.returncode == 0 and "packed SUBCOMMAND" in helped.stdout, helped.stderr[-2000:]
    # the check can fail: an import of a top-level `data` (what 0.2.0's names were) meets the user's
    script.write_text("import data\n")
    shadowed = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert shadowed.returncode == 1 and "the user's own data/__init__.py was imported" in shadowed.stderr


@pytest.mark.slow  # every subcommand's --help in a fresh interpreter
def test_every_subcommand_names_itself_as_the_user_called_it(tmp_path):
    """`packed SUB --help` says `usage: packed SUB` (gather, pretrain, report and plan showed
    module paths or another subcommand's name), and `packed gather FOLDER --output` runs
    as the README writes it (it was refused: the job's own `gather` word was missing)."""
    import subprocess
    import sys

    from packed_transformers.commands.packed import SUBCOMMANDS

    for name in SUBCOMMANDS:
        done = subprocess.run([sys.executable, "-m", "packed_transformers", name, "--help"], cwd=REPO,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, (name, done.stderr)
        assert done.stdout.startswith(f"usage: packed {name} "), (name, done.stdout[:200])
    job = tmp_path / "job"
    job.mkdir()
    gather = subprocess.run([sys.executable, "-m", "packed_transformers", "gather", str(job), "--output",
                             str(tmp_path / "o.npy")], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert gather.returncode == 2
    assert (
        gather.stderr.strip()
        == f"error: {job}: no manifest.json; not a finished --ray job (a failed one leaves none)"
    )


def test_no_test_module_imports_another():
    """Shared builders live in helper modules and conftest.py (issue 80): a test module that
    imports another runs that module's import-time work and couples their fixtures."""
    import ast

    tests = REPO / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                if any(n.split(".")[-1].startswith("test_") for n in names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == [], found


def test_tests_live_in_the_rooms_they_test():
    """tests/<room>/ mirrors the package's rooms (house/: the project's own rules and tools);
    no test module at the top of tests/, none named after the review round that found it."""
    import re

    tests = REPO / "tests"
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"house"}
    modules = sorted(tests.rglob("test_*.py"))
    assert [p.name for p in modules if p.parent == tests] == []
    assert {p.parent.name for p in modules} <= rooms, {p.parent.name for p in modules} - rooms
    # and the other way: every room has its folder of tests (issue 105: components/, engines/
    # and packs/, the rooms every job stands on, had none; their tests lived in training/ and packing/)
    untested = sorted(room for room in rooms if not any(p.parent.name == room for p in modules))
    assert untested == [], f"these rooms have no tests/<room>/test_*.py: {untested}"
    review_round = re.compile(
        r"_(second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)$|first_hour|_round"
    )
    assert [p.stem for p in modules if review_round.search(p.stem)] == []


def test_a_test_that_changes_a_shared_folder_fails_the_session(tmp_path):
    """conftest's session-wide builders (hub_classifier, checkpoint, trained, start_folder) are
    read-only: the check at their teardown sees a changed file."""
    from ..conftest import shared

    (tmp_path / "config.json").write_text("{}")
    builder = shared(tmp_path)
    assert next(builder) == tmp_path
    (tmp_path / "config.json").write_text('{"changed": true}')
    with pytest.raises(AssertionError, match="a test changed this shared folder"):
        next(builder, None)


def drawn_room_sizes(text: str) -> dict[str, int]:
    """room -> the file count ARCHITECTURE.md's drawing of the package gives it (section 6)."""
    import re

    block = text.split("packed_transformers/\n", 1)[1].split("```", 1)[0]
    sizes, pending = {}, []
    for line in block.splitlines():
        rooms = re.findall(r"(\w+)/", line)
        counts = [int(n) for n in re.findall(r"(?<![\w.])(\d+)(?![\w.])", line.split("  ")[-1])]
        if rooms and not counts:
            pending = rooms  # the rooms' line; their counts follow on the next
            continue
        for room, count in zip(pending + rooms if pending else rooms, counts):
            sizes[room] = count
        pending = []
    return sizes


def test_the_drawn_package_is_the_package():
    drawn = drawn_room_sizes((REPO / "ARCHITECTURE.md").read_text())
    actual = {room: modules_and_lines(room)[0] for room in PRODUCT_PACKAGES}
    assert drawn == actual
    # the check can fail: a drawing that forgets a file
    assert drawn_room_sizes("packed_transformers/\n├── door/   x   6\n```") != {"door": 7}
