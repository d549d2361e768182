"""Config files checked against a schema: YAML loading, `--set` overrides, validation,
and the Markdown key table. Every command (pretraining, fine-tuning) declares its own
schema of `Key`s and shares this machinery.

An unknown key names the closest valid key, a bad value names its key, a required key
left unset says what it is for. Values are checked before any data is read.
"""

from __future__ import annotations

import copy
import difflib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packed_transformers.common.input_limits import MAX_INT_DIGITS


class ConfigError(ValueError):
    """A config that cannot run; the message names the key. CLI exit code 2."""


@dataclass(frozen=True)
class Key:
    kind: Any  # int, float, bool, str, "betas", "int_list", "float_list", "str_list"
    default: Any
    doc: str
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False  # None allowed


def differences_from_saved(config: dict, saved: dict, schema: dict, changeable=()) -> list[str]:
    """The keys (section.key) where `config` differs from a saved run's config `saved`, apart
    from those in `changeable` ((section, key) pairs). A key `saved` lacks (added to `schema`
    since it was written, as fine-tuning's contrastive.* after 5b4a0cd) ran at its default then
    and compares by it: an old checkpoint resumes where the user set nothing new."""

    def saved_value(section: str, key: str):
        held = saved.get(section)
        if isinstance(held, dict) and key in held:
            return held[key]
        known = schema.get(section, {}).get(key)
        return known.default if known is not None else _NOT_SAVED

    return sorted(
        f"{section}.{key}" for section in config for key in config[section]
        if (section, key) not in changeable and saved_value(section, key) != config[section][key]
    )  # fmt: skip


# a key neither a saved config nor its schema knows: equal to no value
_NOT_SAVED = object()


def defaults(schema: dict) -> dict:
    return {
        section: {k: copy.deepcopy(v.default) for k, v in keys.items()} for section, keys in schema.items()
    }


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else f"; valid: {', '.join(sorted(options))}"


# Names users bring from other trainers -> ours.
ALIASES = {
    "learning_rate": "lr",
    "batch_size": "micro_batch_packs",
    "micro_batch_size": "micro_batch_packs",
    "num_workers": "loader_workers",
    "grad_accum": "gradient_accumulation",
    "gradient_accumulation_steps": "gradient_accumulation",
    "steps": "max_steps",
    "train_steps": "max_steps",
}


# Keys that moved, old -> new: one name for a setting in every config (fine-tuning's device,
# threads and sharding took pretraining's names). The old name is refused in one line giving the new.
MOVED = {
    "training.device": "execution.device",
    "training.threads": "execution.threads",
    "training.sharding": "execution.sharding",
}


def _suggest(section: str, name: str, schema: dict) -> str:
    """'; did you mean ...' for an unknown key: where it moved, an alias, a near spelling in the
    section, or anywhere."""
    if MOVED.get(f"{section}.{name}") in _all_keys(schema):
        return f"; it is now '{MOVED[f'{section}.{name}']}' (the one name of this setting in every config)"
    keys = schema[section]
    if ALIASES.get(name) in keys:
        return f"; did you mean '{section}.{ALIASES[name]}'?"
    # a misspelt alias ('learnig_rate') means the alias's key, not a near spelling of another
    alias = difflib.get_close_matches(name, [a for a, key in ALIASES.items() if key in keys], n=1, cutoff=0.8)
    if alias:
        return f"; did you mean '{section}.{ALIASES[alias[0]]}'?"
    match = difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)
    if match:
        return f"; did you mean '{section}.{match[0]}'?"
    return _closest(f"{section}.{name}", _all_keys(schema))


def _all_keys(schema: dict) -> list[str]:
    return [f"{s}.{k}" for s, keys in schema.items() for k in keys]


def _check_value(path: str, key: Key, value):
    if value is None:
        # A key without a default is required: `resolve` names it when it is still unset.
        if key.optional or key.default is None:
            return None
        raise ConfigError(f"{path}: must be set (got null)")
    if key.kind in ("int_list", "float_list"):
        item = Key(int if key.kind == "int_list" else float, 0, "", minimum=0)
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{path}: expected a non-empty list of numbers, got {excerpt(value)}")
        return [_check_value(path, item, v) for v in value]
    if key.kind == "str_list":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a non-empty list of strings, got {excerpt(value)}")
        return list(value)
    if key.kind == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"{path}: expected a list of two numbers in [0, 1), got {excerpt(value)}")
        out = [_check_value(path, Key(float, 0, "", minimum=0, maximum=0.999999999), v) for v in value]
        return out
    if key.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {excerpt(value)}")
        return value
    if key.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {excerpt(value)}")
    elif key.kind is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads 1e-3 and 2E5 (no dot) as strings; users write them so.
            try:
                value = float(value.strip())
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {excerpt(value)}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {excerpt(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be finite, got {excerpt(value)}")
    elif key.kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {excerpt(value)}")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{path}: {excerpt(value)} is not one of {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{path}: must be >= {key.minimum}, got {excerpt(value)}")
    if key.maximum is not None and value > key.maximum:
        raise ConfigError(f"{path}: must be <= {key.maximum}, got {excerpt(value)}")
    return value


def resolve(raw: dict, source: str, schema: dict) -> dict:
    """Merge `raw` over `schema`'s defaults and check every key; required keys (no default,
    not optional) must be set. Shared by every command's schema."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    resolved = defaults(schema)
    for section, values in raw.items():
        if section not in schema:
            raise ConfigError(f"{source}: unknown section '{section}'{_closest(section, schema)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        for name, value in values.items():
            if name not in schema[section]:
                raise ConfigError(
                    f"{source}: unknown key '{section}.{name}'" + _suggest(section, name, schema)
                )
            resolved[section][name] = _check_value(f"{section}.{name}", schema[section][name], value)
    for section, keys in schema.items():
        for name, key in keys.items():
            if key.default is None and not key.optional and resolved[section][name] is None:
                raise ConfigError(f"{source}: {section}.{name} must be set ({key.doc})")
    return resolved


def apply_overrides(raw: dict, assignments: list[str], schema: dict) -> dict:
    """`section.key=value` strings (values parsed as YAML) applied to a raw config."""
    raw = copy.deepcopy(raw)
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        path, text = item.split("=", 1)
        if path.count(".") != 1:
            raise ConfigError(
                f"--set {item!r}: expected section.key=value{_closest(path, _all_keys(schema))}"
            )
        section, name = path.split(".")
        if section not in schema:
            raise ConfigError(f"--set: unknown section in '{path}'{_closest(path, _all_keys(schema))}")
        if name not in schema[section]:
            raise ConfigError(f"--set: unknown key '{path}'{_suggest(section, name, schema)}")
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = load_yaml_text(text, f"--set {path}")
    return raw


_SAID_SHIPPED: set[str] = set()  # config paths read from the installed recipes, said once


def read_yaml(path) -> dict:
    """A config file: a mapping of sections (ConfigError naming the file otherwise), parsed
    by load_yaml_text's rules (no key twice, aliases bounded)."""
    path = Path(path)
    if not path.exists():
        from packed_transformers.common.recipes import shipped_config, shipped_config_names

        shipped = shipped_config(path)
        if shipped is None:
            names = ", ".join(shipped_config_names())
            raise ConfigError(f"--config {path}: file not found (the shipped configs, by name: {names})")
        # a pip user's README command in an empty folder: the installed copy, said once a process
        if str(path) not in _SAID_SHIPPED:
            _SAID_SHIPPED.add(str(path))
            print(f"--config {path}: no such file here; reading the installed {shipped.name} "
                  "(`packed recipes` writes configs/ and examples/ here to edit)", file=sys.stderr)  # fmt: skip
        path = shipped
    if not path.is_file():
        raise ConfigError(f"--config {path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not readable as UTF-8 text ({str(err)[:120]})") from None
    raw = load_yaml_text(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw


# Nodes a config may hold once its aliases are expanded: the project's largest config has a few
# hundred; an alias bomb (each level a list of nine aliases of the last) passes 10^9 within
# 500 bytes, and printing or saving it (json, repr) expands every one.
MAX_EXPANDED_NODES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"
INT_TAG = "tag:yaml.org,2002:int"  # past MAX_INT_DIGITS, safe_load's int() is a bare ValueError


def load_yaml_text(text: str, source: str):
    """YAML -> Python values (safe_load's), or ConfigError naming `source`: a key given twice
    in one mapping is refused (PyYAML keeps the last silently; JSON lines and request bodies
    here refuse duplicates too), and a document whose aliases expand past
    MAX_EXPANDED_NODES nodes, or refer to themselves, is refused before it is built."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_yaml_nodes(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({' '.join(str(err).split())[:300]})") from None
    finally:
        loader.dispose()


def check_yaml_nodes(root, source: str) -> None:
    """Duplicate keys and the expanded size of a composed YAML document (node graph: an alias
    is the same node object reached twice)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def expanded(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(
                f"{source}: an alias refers to the value that holds it (line {node.start_mark.line + 1})"
            )
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, value_node in node.value:
                if key_node.tag != MERGE_TAG and isinstance(key_node, yaml.ScalarNode):
                    if (key_node.tag, key_node.value) in seen:
                        raise ConfigError(
                            f"{source}: key {key_node.value[:60]!r} is given twice in one mapping "
                            f"(line {key_node.start_mark.line + 1}); each key once"
                        )
                    seen.add((key_node.tag, key_node.value))
                total += expanded(key_node) + expanded(value_node)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(expanded(item) for item in node.value)
        elif node.tag == INT_TAG and sum(c.isdigit() for c in node.value) > MAX_INT_DIGITS:
            raise ConfigError(
                f"{source}: an integer of more than {MAX_INT_DIGITS} digits (line {node.start_mark.line + 1}); "
                "no setting takes one"
            )
        if total > MAX_EXPANDED_NODES:
            raise ConfigError(
                f"{source}: its aliases expand to more than {MAX_EXPANDED_NODES:,} values "
                f"(line {node.start_mark.line + 1}); a config is far smaller"
            )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    expanded(root)


def excerpt(value, limit: int = 60) -> str:
    """A value as an error line may quote it, bounded: its repr where that is at most `limit`
    characters, else a list or mapping by its size and anything else by its first
    characters."""
    if isinstance(value, (list, tuple, dict)) and len(value) > limit // 2:
        return f"a {'mapping' if isinstance(value, dict) else 'list'} of {len(value)} items"
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, (list, tuple, dict)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'} of {len(value)} items"
    return f"{text[:limit]}... ({len(text)} characters)"


def markdown(schema: dict) -> str:
    lines = []
    for section, keys in schema.items():
        lines += [f"### `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, key in keys.items():
            kind = key.kind if isinstance(key.kind, str) else key.kind.__name__
            if key.choices:
                kind = " \\| ".join(map(str, key.choices))
            lines.append(f"| `{name}` | {kind} | `{key.default}` | {key.doc} |")
        lines.append("")
    return "\n".join(lines)
