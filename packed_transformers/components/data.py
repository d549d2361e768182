"""Packed shards -> micro-batches of tensors, in a resumable, replica-disjoint order.

The order of packs is a pure function of (seed, epoch): a permutation of all packs of
all shards. Micro-batch i of the epoch holds packs order[i*B:(i+1)*B]; replica r of W
takes micro-batches r, r+W, r+2W, ... so replicas never share a pack. A position is
(epoch, micro-batches consumed by the whole job in that epoch): resuming from it replays
nothing and skips nothing. The last incomplete round of W micro-batches of an epoch is
dropped (static shapes and equal work on every replica); the count is logged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from packed_transformers.packing.format import PACKED_FIELDS
from packed_transformers.packing.shards import METADATA, PackedDataset
from packed_transformers.packs.errors import PackingInputError
from packed_transformers.packs.structure import first_malformed


class PackedShards(Dataset):
    """Map-style dataset: item = list of global pack indices -> dict of [B, ...] tensors.

    Shard fields are read through numpy memory maps of the HDF5 file: our shards store
    every field as one contiguous, uncompressed dataset (packing.shards), so a field is
    a plain array at a known file offset, and gathering B random rows is one numpy
    fancy index (~0.2 ms for a micro-batch) instead of h5py's per-selection machinery
    (~5 ms, which stalled every training step on 2 cores). A field h5py reports no
    offset for (chunked or compressed: a file written by another tool) is read through
    h5py. Maps and handles are opened lazily in each DataLoader worker (they do not fork).

    Every read is checked, cheaply enough to leave on (ShardReadError, naming the shard
    and the pack): the shard file is still the one opened, at the size metadata.json
    records (a file truncated under a memory map would otherwise kill the process with
    SIGBUS, and one copied over in place would be read as new bytes silently), and every
    pack read keeps the format's structure and the model's vocabulary
    (packs.structure.first_malformed)."""

    def __init__(
        self, dataset: PackedDataset, vocab_size: int | None = None, type_vocab_size: int | None = None
    ):
        self.dataset = dataset
        self.vocab_size, self.type_vocab_size = vocab_size, type_vocab_size
        rows = [int(s["packs"]) for s in dataset.shards]
        self.starts = np.cumsum([0] + rows)
        self._fields: dict[int, dict] = {}
        self._identity: dict[int, tuple] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard_fields(self, shard: int) -> dict:
        """{field: np.memmap or h5py.Dataset} of one shard."""
        if shard not in self._fields:
            import h5py

            path = self.dataset.shard_path(shard)
            self._identity[shard] = self._check_unchanged(shard, None)
            handle = h5py.File(path, "r")
            fields = {}
            for name in PACKED_FIELDS:
                data = handle[name]
                offset = data.id.get_offset()
                if offset is None or data.chunks is not None or data.compression is not None:
                    fields[name] = data
                else:
                    fields[name] = np.memmap(
                        path, dtype=data.dtype, mode="r", offset=offset, shape=data.shape
                    )
            self._fields[shard] = fields
        return self._fields[shard]

    def _check_unchanged(self, shard: int, opened: tuple | None) -> tuple:
        """The shard file's (inode, size, mtime); ShardReadError when the size is not the
        recorded one or the file is no longer the one opened. A stat per shard per read:
        microseconds. (A change between this stat and the read itself is not caught.)"""
        path = self.dataset.shard_path(shard)
        try:
            info = os.stat(path)
        except OSError as err:
            raise ShardReadError(f"{path}: cannot be read any more ({err.strerror})") from None
        identity = (info.st_ino, info.st_size, info.st_mtime_ns)
        expected = self.dataset.shards[shard]["bytes"]
        if info.st_size != expected or (opened is not None and identity != opened):
            raise ShardReadError(
                f"{path}: changed while the job was reading it ({info.st_size} bytes, "
                f"{METADATA} says {expected}; truncated, rewritten or replaced under a running job)"
            )
        return identity

    def __getitem__(self, packs) -> dict:
        packs = np.asarray(packs, dtype=np.int64)
        shard_of = np.searchsorted(self.starts, packs, side="right") - 1
        out = {}
        for shard in np.unique(shard_of).tolist():
            where = np.flatnonzero(shard_of == shard)
            local = packs[where] - self.starts[shard]
            fields = self._shard_fields(shard)
            self._check_unchanged(shard, self._identity[shard])
            for name, data in fields.items():
                if isinstance(data, np.ndarray):
                    values = data[local]
                else:  # h5py wants strictly increasing indices
                    unique, inverse = np.unique(local, return_inverse=True)
                    values = data[unique.tolist()][inverse]
                if name not in out:
                    out[name] = np.empty((packs.size, *data.shape[1:]), data.dtype)
                out[name][where] = values
        malformed = first_malformed(out, self.vocab_size, self.type_vocab_size)
        if malformed is not None:
            row, what = malformed
            shard = int(shard_of[row])
            raise ShardReadError(
                f"{self.dataset.shard_path(shard)}: pack {int(packs[row] - self.starts[shard])} breaks the "
                f"packed format: {what}"
            )
        # int32/int64 tensors: uint16 has no torch arithmetic on every device
        return {
            name: torch.from_numpy(rows.astype(np.int64 if name == "source_index" else np.int32))
            for name, rows in out.items()
        }

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fields"], state["_identity"] = {}, {}
        return state


class ShardReadError(PackingInputError):
    """A packed shard that cannot be trusted at read time (changed under the job, or a
    pack that breaks the format), naming the shard and the pack."""


def one_line(err: BaseException) -> str:
    """The message of `err` on one line. An error raised in a DataLoader worker arrives
    re-raised with the worker's whole traceback as its message; its last line is
    'module.Class: message'."""
    text = str(err).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return " ".join(text.splitlines())


@dataclass
class LoaderPosition:
    epoch: int = 0
    micro_batches: int = 0  # consumed in this epoch by all replicas together

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "micro_batches": self.micro_batches}


def epoch_order(packs: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(packs)


def micro_batches_per_epoch(packs: int, micro_batch: int, world: int) -> int:
    """Whole rounds of `world` micro-batches that fit in one epoch."""
    return (packs // micro_batch) // world * world


class ReplicaSampler(Sampler):
    """Yields this replica's micro-batches (lists of pack indices) from a position, forever."""

    def __init__(self, packs, micro_batch, seed, rank, world, position: LoaderPosition):
        self.packs, self.micro_batch, self.seed = packs, micro_batch, seed
        self.rank, self.world = rank, world
        self.start = LoaderPosition(position.epoch, position.micro_batches)
        self.per_epoch = micro_batches_per_epoch(packs, micro_batch, world)
        if self.per_epoch == 0:
            raise ValueError(
                f"the data has {packs} packs: fewer than micro_batch_packs x replicas = {micro_batch * world}"
            )

    def __iter__(self):
        epoch, done = self.start.epoch, self.start.micro_batches
        while True:
            order = epoch_order(self.packs, self.seed, epoch)
            for i in range(done + self.rank, self.per_epoch, self.world):
                yield order[i * self.micro_batch : (i + 1) * self.micro_batch].tolist()
            epoch, done = epoch + 1, 0


def advance(position: LoaderPosition, micro_batches: int, per_epoch: int) -> LoaderPosition:
    """The position after the job consumed `micro_batches` more (all replicas together)."""
    total = position.micro_batches + micro_batches
    return LoaderPosition(position.epoch + total // per_epoch, total % per_epoch)


def make_loader(shards: PackedShards, sampler: ReplicaSampler, workers: int) -> DataLoader:
    return DataLoader(
        shards,
        sampler=sampler,
        batch_size=None,  # the sampler yields whole micro-batches
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
        # Its own generator: creating the iterator must not draw from the global RNG, or a
        # resumed run's dropout masks would differ from the uninterrupted run's.
        generator=torch.Generator().manual_seed(sampler.seed),
    )


def eval_batches(
    dataset: PackedDataset,
    micro_batch: int,
    max_sequences: int,
    rank: int,
    world: int,
    vocab_size: int | None = None,
):
    """The first packs (file order) holding at most max_sequences sequences, split over replicas.

    Deterministic and identical for every evaluation; replica r takes micro-batches r, r+W, ...
    Returns (the shards, this replica's micro-batches as lists of pack indices, the
    sequences all replicas evaluate together)."""
    import h5py

    shards = PackedShards(dataset, vocab_size)
    counts = []
    for s in range(len(dataset.shards)):
        with h5py.File(dataset.shard_path(s), "r") as f:
            counts.append(f["next_sentence_weights"][:].sum(axis=1))
    per_pack = np.concatenate(counts)
    cumulative = np.cumsum(per_pack)
    packs = int(np.searchsorted(cumulative, max_sequences, side="right"))
    packs = max(packs, 1)
    batches = [list(range(a, min(packs, a + micro_batch))) for a in range(0, packs, micro_batch)]
    return shards, batches[rank::world], int(cumulative[packs - 1])


def pad_micro_batch(batch: dict, rows: int) -> dict:
    """Append empty packs (all zeros: no sequence, no masked token) up to `rows`: a static
    graph needs full micro-batches, and empty packs add nothing to any sum."""
    have = batch["input_ids"].shape[0]
    if have >= rows:
        return batch
    return {name: torch.cat([t, t.new_zeros((rows - have, *t.shape[1:]))]) for name, t in batch.items()}


def padded_groups(shards: PackedShards, batches: list, group_size: int, rows: int, groups: int | None = None):
    """Evaluation micro-batches for engines with static shapes (a pipeline schedule, a
    compiled graph): `groups` groups (default: enough for `batches`) of `group_size`
    micro-batches of `rows` packs each; the last group is filled with all-empty
    micro-batches, which add nothing to any sum. Yields lists of batch dicts."""
    if groups is None:
        groups = -(-len(batches) // group_size)
    for g in range(groups):
        group = [pad_micro_batch(shards[b], rows) for b in batches[g * group_size : (g + 1) * group_size]]
        if len(group) < group_size:
            like = group[0] if group else pad_micro_batch(shards[[0]], rows)  # shapes only
            group += [
                {k: torch.zeros_like(v) for k, v in like.items()} for _ in range(group_size - len(group))
            ]
        yield group
