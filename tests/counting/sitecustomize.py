"""Loaded at start-up by the commands tests/house_helpers.py `counted_run` starts (this folder
on PYTHONPATH): counts, for the whole process, how often config.json of the folder in
$COUNT_FOLDER is opened to be read (a Python audit hook: every open in the process,
transformers' own included; common.files.sha256_file's digest of its bytes is not a read of
what it says and is left out) and how many transformers tokenizers are built (PreTrainedTokenizerBase.__init__,
patched when transformers imports it), and writes {"config_json": n, "tokenizer_builds": m}
to $COUNT_OUTPUT at exit. $COUNT_PLANT=config or tokenizer plants a second reader (after the
door opens the folder), to show each count can fail. A $COUNT_OUTPUT holding "{pid}" is one
file per process (a Ray job's driver and its actors, which inherit the environment), written
at every count as well as at exit: Ray may end its workers without running atexit."""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

FOLDER = os.path.realpath(os.environ["COUNT_FOLDER"])
counts = {"config_json": 0, "tokenizer_builds": 0}


PER_PROCESS = "{pid}" in os.environ["COUNT_OUTPUT"]


def digest_only() -> bool:
    """Whether the open under way is common.files.sha256_file's: a digest of the bytes (a Ray
    job ties its kept shards to the model's content), not a parse."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "sha256_file":
            return True
        frame = frame.f_back
    return False


def audit(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if (
            os.path.basename(path) == "config.json"
            and os.path.realpath(path) == os.path.join(FOLDER, "config.json")
            and not digest_only()
        ):
            counts["config_json"] += 1
            if PER_PROCESS:
                write()


def patch_tokenizers(module):
    base = module.PreTrainedTokenizerBase
    original = base.__init__

    def counted_init(self, *args, **kwargs):
        counts["tokenizer_builds"] += 1
        if PER_PROCESS:
            write()
        return original(self, *args, **kwargs)

    base.__init__ = counted_init


def plant(module):
    """A second reader after the door: the planted fault each count must see."""
    original = module.open_folder

    def open_twice(folder, *args, **kwargs):
        loaded = original(folder, *args, **kwargs)
        if os.environ["COUNT_PLANT"] == "config":
            with open(os.path.join(FOLDER, "config.json")) as handle:
                json.load(handle)
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(FOLDER)
        return loaded

    module.open_folder = open_twice


AFTER_IMPORT = {"transformers.tokenization_utils_base": patch_tokenizers}
if os.environ.get("COUNT_PLANT"):
    AFTER_IMPORT["packed_transformers.door.opener"] = plant


class AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs AFTER_IMPORT[name] on a module once it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self.loaders = getattr(self, "loaders", {})
        self.loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self.loaders[module.__name__].exec_module(module)
        AFTER_IMPORT[module.__name__](module)


def write():
    path = os.environ["COUNT_OUTPUT"].replace("{pid}", str(os.getpid()))
    with open(path + ".tmp", "w") as handle:
        json.dump(counts, handle)
    os.replace(path + ".tmp", path)


sys.addaudithook(audit)
sys.meta_path.insert(0, AfterImport())
atexit.register(write)
