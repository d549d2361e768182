"""`packed debian-texts`: Debian's package descriptions as C4-style JSON lines (`{"text": ...}`).

    sudo apt-get update -o Acquire::Languages=en     # the long descriptions (Translation-en)
    packed debian-texts --output work/lm_text/debian.jsonl [--lists /var/lib/apt/lists]

Real English prose of many lengths (a one-line synopsis to several paragraphs) that every
Debian or Ubuntu machine holds: apt's list files. Each description is one document, its
synopsis as the first line and its paragraphs after (a lone "." is Debian's blank line).
Read from every `*_Translation-en*` list (long descriptions) or, where apt fetched none,
the `*_Packages*` lists (synopses only); compressed lists are read through apt's own
`apt-helper cat-file`. Identical descriptions (shared by a package's variants) are kept
once. The file appears by atomic rename.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packed_transformers.common.cli import command_parser, refuse

APT_HELPER = "/usr/lib/apt/apt-helper"
DESCRIPTION_KEYS = ("Description-en:", "Description:")


def list_text(path: Path) -> str:
    """A list file's text (apt-helper decompresses .lz4/.gz/.xz; plain files are read)."""
    if path.suffix in ("", ".txt") or not Path(APT_HELPER).exists():
        return path.read_text(encoding="utf-8", errors="replace")
    done = subprocess.run([APT_HELPER, "cat-file", str(path)], capture_output=True, timeout=600)
    if done.returncode != 0:
        raise OSError(
            f"{path}: apt-helper cat-file failed ({done.stderr.decode(errors='replace').strip()[:160]})"
        )
    return done.stdout.decode("utf-8", errors="replace")


def descriptions(text: str):
    """Each package record's description: synopsis, then the long description's lines."""
    current = None
    for line in text.splitlines():
        if line.startswith(DESCRIPTION_KEYS):
            if current:
                yield "\n".join(current).strip()
            current = [line.split(":", 1)[1].strip(), ""]
        elif line.startswith(" ") and current is not None:
            current.append("" if line.strip() == "." else line[1:])
        else:
            if current:
                yield "\n".join(current).strip()
            current = None
    if current:
        yield "\n".join(current).strip()


def debian_texts(lists: Path) -> tuple[list[str], list[Path]]:
    """(unique descriptions in list order, the list files read)."""
    files = sorted(lists.glob("*_Translation-en*")) or sorted(lists.glob("*_Packages*"))
    if not files:
        raise FileNotFoundError(f"{lists}: no *_Translation-en or *_Packages list (run apt-get update)")
    seen, out = set(), []
    for path in files:
        for text in descriptions(list_text(path)):
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out, files


def main(argv=None) -> int:
    parser = command_parser("packed debian-texts", __doc__)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--lists", type=Path, default=Path("/var/lib/apt/lists"), help="apt's list folder")
    parser.add_argument("--limit", type=int, default=None, help="at most this many documents")
    args = parser.parse_args(argv)
    from packed_transformers.common.files import atomic_path, describe_os_error

    if args.limit is not None and args.limit < 1:  # texts[:-1] would drop the last one silently
        return refuse(f"--limit must be a positive number of documents, got {args.limit}")

    try:
        texts, files = debian_texts(args.lists)
        texts = texts[: args.limit]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp, tmp.open("w") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    except FileNotFoundError as err:
        return refuse(str(err))
    except OSError as err:
        return refuse(describe_os_error(err))
    print(f"{len(texts)} descriptions from {len(files)} list files -> {args.output}", file=sys.stderr)
    if not any("_Translation-en" in path.name for path in files):  # apt has not fetched them yet
        print("synopses only (one line each): `apt-get update -o Acquire::Languages=en` fetches the long "
              "descriptions", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
