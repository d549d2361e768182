"""ARCHITECTURE.md's module rules, checked in a fresh interpreter per package: importing a
package loads none of what it must never use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import PACKAGE, REPO

# End to end (whole runs, subprocesses): `pytest -m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

# package (inside packed_transformers) -> module prefixes it must never load (directly or through
# its imports); a room's name means that room of packed_transformers, any other a library
ROOMS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {"run_pretraining"}
RULES = {
    "common": [
        "torch",
        "numpy",
        "packs",
        "packing",
        "model",
        "optim",
        "components",
        "training",
        "finetune",
        "data",
    ],
    "packs": ["torch", "h5py", "packing", "model", "optim", "training", "finetune", "poptorch"],
    "packing": ["torch", "model", "optim", "training", "finetune", "poptorch"],
    "model": ["packs", "packing", "scipy", "poptorch", "components", "training", "finetune", "optim", "data"],
    "optim": ["model", "packs", "packing", "training", "finetune", "poptorch"],
    "data": ["torch", "model", "training", "finetune", "optim"],
    "finetune.train": ["training", "poptorch", "serving"],
    "finetune.predict": ["training", "poptorch", "serving"],
    "hf_integration.trainer": ["training", "poptorch", "serving"],
    "hf_integration.pipeline": ["training", "poptorch", "serving"],
    "finetune.serve": ["training", "poptorch", "torch", "uvicorn", "serving"],  # an alias: runs serving
    "serving.cli": ["training", "poptorch", "torch", "uvicorn"],  # parses first, then imports
    "serving.app": ["training", "poptorch"],
    "components": ["training", "finetune", "poptorch", "door", "inference"],
    "engines.torch_engine": ["training", "finetune", "poptorch", "door", "inference"],
    "training.run": ["poptorch", "finetune", "horovod", "popdist"],
    "engines": ["poptorch", "finetune", "horovod", "popdist"],
    "engines.ipu": ["poptorch", "horovod", "popdist"],  # imported only inside functions
    "engines.ipu_plan": ["poptorch", "horovod", "popdist"],
    "run_pretraining": ["poptorch", "training", "finetune"],  # parses first, then imports the run
}


def full_name(name: str) -> str:
    return f"packed_transformers.{name}" if name.split(".")[0] in ROOMS else name


def loaded_modules(package: str) -> set[str]:
    code = f"import sys, json, {full_name(package)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_loads_nothing_it_must_never_use(package):
    loaded = loaded_modules(package)
    broken = sorted(
        name
        for name in loaded
        for banned in map(full_name, RULES[package])
        if (name == banned or name.startswith(banned + ".")) and not full_name(package).startswith(banned)
    )
    assert not broken, f"importing {package} loads {broken}"


def imports_of(path) -> set[str]:
    """Every module a Python file names in an import statement (at any depth)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {name.removeprefix("packed_transformers.") for name in names}


@pytest.mark.parametrize(
    "importer,banned",
    [("finetune", "serving"), ("model", "packing"), ("model", "training"), ("finetune", "training")],
)
def test_no_import_statement_crosses_a_rule(importer, banned):
    """Statically, lazy imports inside functions included: serving/ builds on finetune/ (never
    the reverse; `python -m packed_transformers.finetune.serve` runs serving as a module, importing nothing);
    model/ knows nothing of packing/ or the run."""
    crossing = [
        f"{path.relative_to(PACKAGE).as_posix()}: {name}"
        for path in sorted((PACKAGE / importer).rglob("*.py"))
        for name in imports_of(path)
        if name == banned or name.startswith(banned + ".")
    ]
    assert not crossing, crossing


def test_static_rule_check_sees_a_crossing(tmp_path):
    """The static check above finds an import of serving/ written inside a function."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from packed_transformers.serving.app import create_app\n"
        "    import packed_transformers.packs.structure\n"
    )
    assert {"serving.app", "packs.structure"} <= imports_of(probe)


def test_engines_do_not_import_the_runs():
    """Engines sit side by side below every run (BERT's, the decoder's, fine-tuning's); none
    imports a run's room, statically (imports inside functions too)."""
    for path in sorted((PACKAGE / "engines").glob("*.py")):
        crossing = {name for name in imports_of(path) if name.split(".")[0] in ("training", "finetune")}
        assert not crossing, f"engines/{path.name} imports {sorted(crossing)}"
    importers = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if not {".venv", ".venv-tf", "tests"} & set(p.parts)  # tests/ hold the PopTorch double
        and any(line.strip() == "import poptorch" for line in p.read_text().splitlines())
    ]
    assert importers == ["engines/ipu.py"]


def test_only_an_engine_writes_the_backward():
    """The step is the engine's (issue 95): `.backward(` is written in engines/ alone, once for
    every job on torch (the pipeline's schedule and PopTorch run their own backward)."""
    writers = sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if any(
            ".backward(" in line and not line.lstrip().startswith("#") for line in p.read_text().splitlines()
        )
    )
    assert writers == ["engines/torch_engine.py"], writers


def test_every_job_shares_one_diverged_and_one_replica_type():
    """Issue 107: one `Diverged` (a run that stopped being finite, exit 3) and one replica type
    (this process among the run's: BERT's engines, the decoder and fine-tuning) are defined in
    the whole package, and pretraining's command asks once which job a config is."""
    import re

    def definers(pattern: str) -> list[str]:
        return sorted(
            f"{p.relative_to(PACKAGE).as_posix()}:{name}"
            for p in PACKAGE.rglob("*.py")
            for name in re.findall(rf"^class ({pattern})\b", p.read_text(), flags=re.MULTILINE)
        )

    assert definers(r"\w*Diverged\w*") == ["components/run_state.py:Diverged"]
    assert definers(r"Replicas?|\w*ReplicaInfo") == ["components/distributed.py:Replicas"]
    # the pretraining command picks its job once, from the registered specs (training/specs.py)
    command = (PACKAGE / "run_pretraining.py").read_text()
    assert (
        command.count("spec_of(") == 1
        and "is_decoder_config" not in command
        and "decoder" not in re.sub(r"(?s)\"\"\".*?\"\"\"|#.*|\"[^\"\n]*\"", "", command)
    ), "run_pretraining.py branches on the job itself"
    asks = sum(p.read_text().count("is_decoder_config(") for p in PACKAGE.rglob("*.py"))
    assert asks == 2, f"is_decoder_config asked {asks} times (its definition and training/specs.py's spec_of)"


def test_every_fine_tuning_job_is_a_registered_spec_picked_once():
    """Issue 107: `packed train` picks its job once, from the registered specs
    (finetune/specs.py: every data.task, a reranker too); nothing after it branches on data.task
    to choose a reader or a trainer, and the config check's sources are the specs' table."""
    import re

    from packed_transformers.finetune.config import SCHEMA
    from packed_transformers.finetune.specs import SPECS, TASKS

    assert set(TASKS) == set(SPECS) == set(SCHEMA["data"]["task"].choices)
    assert {spec.name for spec in SPECS.values() if spec.read_input is None} == {"rerank"}
    train = (PACKAGE / "finetune" / "train.py").read_text()
    assert train.count("spec_for(config)") == 2, "main picks the job; a Run built without one picks it"
    choosers = sorted(p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "finetune").rglob("*.py")
                      if re.search(r'\["task"\] (==|in|!=) |\["task"\]\]', p.read_text()))  # fmt: skip
    assert choosers == ["finetune/config.py", "finetune/folder_writer.py", "finetune/specs.py"], choosers


def test_every_engine_steps_the_loss_a_job_hands_it():
    """Issue 107: the Engine interface's step is job-agnostic: the torch, pipeline and IPU
    engines each take `step(micro_batches, loss, lr)` and answer a StepResult; none has a
    BERT-only `train`; the pipeline and IPU engines refuse a loss they cannot stage."""
    import inspect

    import pytest

    from packed_transformers.components.errors import RunError
    from packed_transformers.engines.engine import (
        PER_TOKEN,
        Engine,
        PretrainingLoss,
        StepResult,
        staged_loss_only,
    )
    from packed_transformers.engines.ipu import IpuEngine
    from packed_transformers.engines.pipeline import PipelineEngine
    from packed_transformers.engines.torch_engine import TorchEngine

    for engine in (Engine, TorchEngine, PipelineEngine, IpuEngine):
        assert list(inspect.signature(engine.step).parameters) == ["self", "micro_batches", "loss", "lr"], (
            engine
        )
        assert not hasattr(engine, "train"), f"{engine.__name__}.train: a BERT-only step"
        if engine is not Engine:
            assert inspect.signature(engine.step).return_annotation in ("StepResult", StepResult), engine
    staged_loss_only("pipeline", PER_TOKEN)
    with pytest.raises(RunError, match="stages BERT's per-token pretraining loss alone"):
        staged_loss_only("IPU", PretrainingLoss("per_sequence"))


def test_every_run_is_set_up_by_the_one_trainer():
    """Issue 107: BERT's run (every engine), the decoder's and fine-tuning's are jobs of
    components.trainer.Trainer, whose __init__ is the one setup order; no run writes its own
    (a job's __init__ only keeps its own arguments and hands on), and only the Trainer prepares
    a run folder, writes config.yaml, opens the reporter or reads a resume checkpoint."""
    import inspect
    import re

    from packed_transformers.components.trainer import PretrainingTrainer, Trainer
    from packed_transformers.finetune.train import Run as FinetuneRun
    from packed_transformers.training.decoder.run import DecoderRun
    from packed_transformers.training.run import Run as BertRun

    assert issubclass(BertRun, PretrainingTrainer) and issubclass(DecoderRun, PretrainingTrainer)
    assert issubclass(FinetuneRun, Trainer) and not issubclass(FinetuneRun, PretrainingTrainer)
    for run in (BertRun, DecoderRun, FinetuneRun):
        if "__init__" in vars(run):
            body = inspect.getsource(run.__init__).splitlines()[1:]
            code = [line for line in body if line.strip() and not line.strip().startswith(("#", '"""'))]
            assert len(code) <= 3 and "super().__init__(" in code[-1], (
                f"{run.__qualname__}.__init__ sets up itself"
            )
    rooms = ("training", "finetune", "components", "engines")
    defined_in = {"prepare_output": "components/run_folder.py", "write_run_config": "components/run_folder.py",
                  "Reporter": "components/observe.py", "resume_pretraining": "components/run_checkpoint.py"}  # fmt: skip
    for name, home in defined_in.items():
        users = sorted(p.relative_to(PACKAGE).as_posix() for room in rooms for p in (PACKAGE / room).rglob("*.py")
                       if re.search(rf"(?<![\w.])(ckpt_run\.)?{name}\(", p.read_text()))  # fmt: skip
        assert sorted(set(users) - {home}) == ["components/trainer.py"], (name, users)
    # every run on torch holds the torch engine (its step, checkpoint parts and restore), none a
    # bare TorchStep or a forward of its own
    for name in ("TorchStep", "forward_of"):
        users = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                       if re.search(rf"(?<![\w.]){name}\(", p.read_text()))  # fmt: skip
        assert users == ["engines/torch_engine.py"], (name, users)


def test_every_job_loads_checkpoint_weights_one_way():
    """Issue 107: a checkpoint's weights reach a model through components.replicas.load_weights
    alone (strict; a tied alias filled; FSDP2's shards each rank's), whichever job wrote them: no
    training room loads a model's state dict its own way (an optimizer's, a scaler's are their
    own; model/ opens Hugging Face folders, which are not checkpoints)."""
    rooms = ("training", "finetune", "components", "engines", "optim")
    loaders = sorted(
        {
            p.relative_to(PACKAGE).as_posix()
            for room in rooms
            for p in (PACKAGE / room).rglob("*.py")
            for line in p.read_text().splitlines()
            if ".load_state_dict(" in line
            and not line.lstrip().startswith("#")
            and not any(
                other in line for other in ("optimizer", "scaler", "super()", "part.")
            )  # a Stateful part
        }
    )
    assert loaders == ["components/replicas.py"], loaders


def test_every_job_writes_and_restores_its_checkpoint_one_way():
    """Issue 107: BERT's, the decoder's and fine-tuning's checkpoints are written by
    components.run_checkpoint.write_checkpoint alone (the RNG gathered, rank 0 or every shard
    writing, a failed write raised on every rank) and restored by components.run_checkpoint.restore
    alone (the resume policy, the run state, this rank's RNG): no run calls the folder writer,
    the resume policy or the RNG's gathering or setting itself; and a checkpoint's weights are
    loaded by components.run_checkpoint.load_model_weights alone."""
    import re

    def callers(name: str) -> list[str]:
        return sorted(
            p.relative_to(PACKAGE).as_posix()
            for p in PACKAGE.rglob("*.py")
            if re.search(rf"(?<![\w.])((ckpt|ckpt_run)\.)?{name}\(", "\n".join(
                line for line in p.read_text().splitlines() if not line.lstrip().startswith(("def ", "#"))))
        )  # fmt: skip

    assert callers("save_checkpoint") == callers("gather_rng_states") == ["components/run_checkpoint.py"]
    assert callers("resume_from") == callers("set_rng_state") == ["components/run_checkpoint.py"]
    # fine-tuning restores; the two pretraining runs through resume_pretraining (its refusals as
    # RunError; what a crash left half-written removed first), and forget their later lines alike
    assert sorted(set(callers("restore")) - {"components/run_checkpoint.py"}) == ["finetune/train.py"]
    trainer = ["components/trainer.py"]  # the pretraining runs' one setup
    for name in ("resume_pretraining", "forget_lines_after"):
        assert sorted(set(callers(name)) - {"components/run_checkpoint.py"}) == trainer, name
    assert callers("forget_metrics_after") == ["components/run_checkpoint.py"]
    # a checkpoint's parts besides the engine's are the Trainer's one list (Trainer.parts: the run
    # state, the RNG), every job's; training_state.pt is saved by the one writer alone
    assert sorted(set(callers("RngStates")) - {"components/run_checkpoint.py"}) == ["components/trainer.py"]
    assert sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                  if '"training_state.pt")' in p.read_text() and "torch.save(" in p.read_text()) == [
        "components/checkpoint.py"]  # fmt: skip
    assert sorted(set(callers("write_checkpoint")) - {"components/loop.py", "components/run_checkpoint.py"}) == [
        "components/trainer.py", "finetune/train.py"]  # fmt: skip
    # one weight loader: a checkpoint's model/ is read by load_model_weights alone
    # (BERT before its engine attaches, the decoder and fine-tuning through TorchStep.restore, which
    # reads a sharded run's dcp/ as well, on any number of ranks)
    assert sorted(set(callers("load_model_weights")) - {"components/run_checkpoint.py"}) == [
        "engines/torch_engine.py", "training/run.py"]  # fmt: skip
    assert sorted(set(callers("load_sharded")) - {"components/sharding.py"}) == ["engines/torch_engine.py"]
    # one sharded policy for every job: TorchStep.snapshot (every rank's shards of the model and
    # optimizer in dcp/, model/ gathered whole), the Snapshot every job hands write_checkpoint
    # (BERT's from any engine, the decoder's and fine-tuning's from their TorchStep); no rank
    # gathers a whole optimizer state
    assert sorted(set(callers("shards_writer")) - {"components/sharding.py"}) == ["engines/torch_engine.py"]
    snapshots = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                       if re.search(r"engine\.snapshot\(", p.read_text()))  # fmt: skip
    assert snapshots == ["finetune/train.py", "training/decoder/run.py", "training/run.py"]
    assert not any("full_tensor()" in p.read_text() for p in PACKAGE.rglob("*.py"))
    rooms = ("training", "finetune", "components", "engines", "optim")
    assert sorted({path for room in rooms for path in callers("load_file") if path.startswith(room)}) == [
        "components/run_checkpoint.py"]  # fmt: skip
