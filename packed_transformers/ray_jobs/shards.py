"""The --ray job's data on disk (ray_jobs.job runs the job): the inputs planned into
chunks (JSON lines counted, byte offsets kept; Parquet row groups), a chunk's rows read and
checked as the single-process command checks them, each chunk's shard written by atomic
rename (`ShardWriter`, one model per Ray actor), the shards checked to hold every row exactly
once (`verify_shards`), and a partial job's intact shards found for reuse."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packed_transformers.common.files import describe_os_error, write_json_atomic
from packed_transformers.data.classification_data import ExampleError, example_of_line

INPUT_SUFFIXES = (".jsonl", ".json", ".parquet")


class JobIncomplete(RuntimeError):
    """The shards do not hold every row exactly once; the message says which are off."""


@dataclass(frozen=True)
class Chunk:
    """One actor call's share of the input: `rows` rows of `path` from `first_row` (a
    0-based line or row number inside the file), indices from `first_index`."""

    number: int
    path: str
    parquet: bool
    first_index: int
    first_row: int
    rows: int
    offset: int = 0  # JSON lines: the byte where the chunk's first line starts
    row_group: int = -1  # Parquet: the row group the chunk is
    digest: str = ""  # JSON lines: a hash of the chunk's bytes (what a kept shard was computed from)


# ----- inputs ------------------------------------------------------------------------------------
def input_files(spec: str) -> list[Path]:
    """--input as given: a folder (its .jsonl / .json / .parquet files), a glob, or a file;
    sorted by path. ExampleError where nothing is matched."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in INPUT_SUFFIXES and p.is_file())
        if not files:
            raise ExampleError(f"--input {spec}: a folder with no {', '.join(INPUT_SUFFIXES)} files")
        return files
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec) if Path(p).is_file())
        if not files:
            raise ExampleError(f"--input {spec}: the pattern matches no file")
        return files
    if not path.exists():
        raise ExampleError(f"--input {spec}: file not found")
    return [path]


def plan_chunks(files: list[Path], chunk_rows: int, text_field: str) -> list[Chunk]:
    """The chunks of every file in order (see the module docstring). Blank JSON lines, a
    Parquet file without the text column, or one that is not Parquet: ExampleError."""
    import pyarrow.parquet as pq

    chunks: list[Chunk] = []
    index = 0
    for path in files:
        if path.suffix == ".parquet":
            try:
                parquet = pq.ParquetFile(path)
            except Exception as err:  # noqa: BLE001 - pyarrow's ArrowInvalid and kin: the file is not Parquet
                raise ExampleError(
                    f"{path}: not a readable Parquet file ({str(err).splitlines()[0][:120]})"
                ) from None
            names = parquet.schema_arrow.names
            if text_field not in names:
                raise ExampleError(f"{path}: no column '{text_field}'; its columns: {', '.join(names)}")
            first_row = 0
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if rows:
                    chunks.append(
                        Chunk(len(chunks), str(path), True, index, first_row, rows, row_group=group)
                    )
                index, first_row = index + rows, first_row + rows
            continue
        start_line, start_offset, offset, lines = 0, 0, 0, 0
        digest = hashlib.blake2b(digest_size=16)
        with path.open("rb") as f:
            for number, raw in enumerate(f):
                if not raw.strip():
                    raise ExampleError(
                        f"{path}:{number + 1}: blank line; every line must be a JSON object with a string "
                        f"'{text_field}' (row `index` is the line number)"
                    )
                if number - start_line == chunk_rows:
                    chunks.append(Chunk(len(chunks), str(path), False, index, start_line, chunk_rows, start_offset,
                                        digest=digest.hexdigest()))  # fmt: skip
                    index, start_line, start_offset = index + chunk_rows, number, offset
                    digest = hashlib.blake2b(digest_size=16)
                digest.update(raw)
                offset += len(raw)
                lines = number + 1
        if lines > start_line:
            chunks.append(Chunk(len(chunks), str(path), False, index, start_line, lines - start_line, start_offset,
                                digest=digest.hexdigest()))  # fmt: skip
            index += lines - start_line
    if not chunks:
        raise ExampleError(f"--input: no rows in {', '.join(map(str, files))}")
    return chunks


def read_chunk(chunk: Chunk, text_field: str, pair_field: str | None):
    """-> (texts, pairs or None, where(i) naming row i as file:line or file: row N)."""
    if chunk.parquet:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(chunk.path)
        columns = [text_field] + (
            [pair_field] if pair_field and pair_field in parquet.schema_arrow.names else []
        )
        table = parquet.read_row_group(chunk.row_group, columns=columns)
        texts = table.column(text_field).to_pylist()
        pairs = table.column(pair_field).to_pylist() if len(columns) == 2 else None
        return texts, pairs, lambda i: f"{chunk.path}: row {chunk.first_row + i}"
    texts, pairs = [], []
    with open(chunk.path, "rb") as f:
        f.seek(chunk.offset)
        for i in range(chunk.rows):
            raw = f.readline()
            text, pair, _ = example_of_line(
                raw, f"{chunk.path}:{chunk.first_row + i + 1}", text_field, pair_field
            )
            texts.append(text)
            pairs.append(pair)
    if len(texts) != chunk.rows:
        raise ExampleError(
            f"{chunk.path}: {len(texts)} lines read where {chunk.rows} were counted; the file changed"
        )
    return (
        texts,
        (pairs if any(p is not None for p in pairs) else None),
        lambda i: f"{chunk.path}:{chunk.first_row + i + 1}",
    )


# ----- the actors ---------------------------------------------------------------------------------
def shard_name(number: int) -> str:
    return f"part-{number:06d}.parquet"


class ShardWriter:
    """A Ray actor's work: the model loaded once, then chunk -> rows -> packed outputs ->
    one Parquet shard written by atomic rename. -> {"number", "rows", "error"} per chunk ("" where written)."""

    def __init__(self, job: dict):
        from packed_transformers.ray_jobs.actors import PackedEmbedder, PackedPredictor

        self.job, self.folder = job, Path(job["folder"])
        engine = PackedEmbedder if job["kind"] == "embed" else PackedPredictor
        self.engine = engine(job["model"], **job["options"])

    def __call__(self, batch: dict) -> dict:
        """A refused chunk (a bad row, an unreadable file) is returned with its one line,
        not raised: the other chunks go on, and the driver names it."""
        numbers, rows, errors = [], [], []
        for values in zip(*(batch[name] for name in Chunk.__dataclass_fields__)):
            chunk = Chunk(*(v.item() if hasattr(v, "item") else v for v in values))
            try:
                self.write(chunk)
                errors.append("")
            except ExampleError as err:
                errors.append(str(err).splitlines()[0])
            except OSError as err:
                errors.append(describe_os_error(err))
            numbers.append(chunk.number)
            rows.append(chunk.rows)
        return {"number": np.array(numbers), "rows": np.array(rows), "error": np.array(errors, dtype=object)}

    def write(self, chunk: Chunk) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from packed_transformers.ray_jobs.actors import with_columns

        texts, pairs, where = read_chunk(chunk, self.job["text_field"], self.job.get("pair_field"))
        index = pa.table(
            {"index": np.arange(chunk.first_index, chunk.first_index + chunk.rows, dtype=np.int64)}
        )
        if self.job["kind"] == "embed":
            table = with_columns(index, {"embedding": self.engine.embed(texts, where)})
        else:
            records = self.engine.records(texts, pairs, where)
            name = "labels" if self.engine.multi_label else "label"
            table = with_columns(
                index,
                {name: [r[name] for r in records], "scores": [list(r["scores"].values()) for r in records]},
            )
        final = self.folder / shard_name(chunk.number)
        partial = self.folder / f".{final.name}.tmp-{os.getpid()}"
        pq.write_table(table, partial)
        os.replace(partial, final)  # a retried chunk replaces its shard: one file per chunk


def verify_shards(folder: Path, chunks: list[Chunk]) -> list[dict]:
    """Every chunk's shard present and the `index` columns together 0..N-1 exactly once.
    -> the manifest's shard list. JobIncomplete naming what is missing or repeated."""
    import pyarrow.parquet as pq

    total = sum(c.rows for c in chunks)
    seen = np.zeros(total, dtype=np.int64)
    shards = []
    for chunk in chunks:
        path = folder / shard_name(chunk.number)
        if not path.exists():
            raise JobIncomplete(f"chunk {chunk.number} ({chunk.path}, {chunk.rows} rows) has no shard")
        index = pq.read_table(path, columns=["index"]).column("index").to_numpy()
        if index.size and (index.min() < 0 or index.max() >= total):
            raise JobIncomplete(f"{path.name}: index outside 0..{total - 1}")
        np.add.at(seen, index, 1)
        shards.append({"file": path.name, "rows": int(index.size), "first_index": chunk.first_index})
    missing, repeated = np.flatnonzero(seen == 0), np.flatnonzero(seen > 1)
    if missing.size or repeated.size:
        raise JobIncomplete(
            f"{missing.size} rows missing (first {missing[:3].tolist()}), {repeated.size} repeated "
            f"(first {repeated[:3].tolist()}) of {total}"
        )
    for stray in folder.glob(".part-*.tmp-*"):  # a killed writer's temporary: never a row of the output
        stray.unlink()
    return shards


def partial_folder(output: Path) -> Path:
    """Where a job writes until it is complete: beside --output, one name per output, so
    that a failed or interrupted job's finished chunks are found again by the next run."""
    return output.with_name(f".{output.name}.partial")


def chunk_key(chunk: Chunk) -> list:
    """What a chunk's shard was computed from: the chunk (JSON lines: its bytes' hash, so
    that fixing one line recomputes only its chunk); Parquet: also its file's size and mtime."""
    if not chunk.parquet:  # not its byte offset: fixing an earlier line may move it, not change it
        return [chunk.path, chunk.first_index, chunk.first_row, chunk.rows, chunk.digest]
    stat = os.stat(chunk.path)
    return [*asdict(chunk).values(), stat.st_size, stat.st_mtime_ns]


def shard_intact(path: Path, rows: int) -> bool:
    """A kept shard is reused only if it is a readable Parquet file of its chunk's rows: a
    damaged one (cut by a full disk, edited) is computed again, not failed on at every rerun."""
    import pyarrow.parquet as pq

    if not path.is_file() or path.is_symlink():
        return False
    try:
        return pq.read_metadata(path).num_rows == rows
    except Exception:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        return False


def reusable_chunks(partial: Path, job_key: dict, chunks: list[Chunk]) -> set[int]:
    """Set up the partial folder for this job (plan.json: the job and every chunk's key),
    keeping the shards an earlier run of the same job (model, options, fields) wrote for
    chunks whose input is unchanged. -> their numbers; every other file there is removed."""
    plan = {"job": job_key, "chunks": {str(c.number): chunk_key(c) for c in chunks}}
    kept: set[int] = set()
    plan_path = partial / "plan.json"
    if plan_path.is_file():
        try:
            earlier = json.loads(plan_path.read_text())
        except ValueError:
            earlier = {}
        if earlier.get("job") == job_key:
            kept = {c.number for c in chunks if earlier["chunks"].get(str(c.number)) == plan["chunks"][str(c.number)]
                    and shard_intact(partial / shard_name(c.number), c.rows)}  # fmt: skip
    partial.mkdir(parents=True, exist_ok=True)
    for path in partial.iterdir():
        if path.name != "plan.json" and path.name not in {shard_name(n) for n in kept}:
            path.unlink()
    write_json_atomic(plan_path, plan)
    return kept
