"""The README's recipes as installed with the package: its configs (`configs/*.yaml`, every key
documented in configs/README.md) and the examples' inputs and scripts (`examples/`), kept in
packed_transformers/recipes/ (the repository's configs/ and examples/ are links to them), so
that a pip user runs every recipe from an empty folder.

    shipped_config("configs/finetune_own.yaml")   # the installed copy's path, or None
    shipped_config("finetune_own")                # the same, by its name alone
    RECIPES / "examples" / "classify" / "new_texts.jsonl"

A config path that names no file here but names a shipped config (by its file name, with or
without `configs/` and `.yaml`) is read from the installed copy, and the command says so in one
line (common.config_schema.read_yaml); `packed recipes --output DIR` (commands.recipes) writes
both folders out to edit. Standard library only.
"""

from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
CONFIGS = RECIPES / "configs"
EXAMPLES = RECIPES / "examples"


def shipped_config_names() -> list[str]:
    """The shipped configs' names (file names without .yaml), sorted."""
    return sorted(path.stem for path in CONFIGS.glob("*.yaml"))


def shipped_config(given) -> Path | None:
    """The shipped config `given` names (`configs/NAME.yaml`, `NAME.yaml` or `NAME`), or None:
    a path with other folders in it, or a name no shipped config has."""
    given = Path(given)
    if given.parent not in (Path("."), Path("configs")):
        return None
    name = given.name[: -len(".yaml")] if given.name.endswith(".yaml") else given.name
    path = CONFIGS / f"{name}.yaml"
    return path if name and path.is_file() else None
