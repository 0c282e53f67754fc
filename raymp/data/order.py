"""The global sample order. Epoch e is a seeded permutation of the training samples; the order
is epoch 0, then epoch 1, ... end to end, and step s consumes positions [s*G, (s+1)*G) of it.

The order depends only on (seed, dataset), never on dp or G, so a run resumed with another
number of replicas (or even another batch size) reads exactly the samples an uninterrupted run
would, with none lost or repeated: the position is just the count of samples consumed.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np


@functools.lru_cache(maxsize=4)
def split_ids(num_samples: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train sample ids, validation sample ids): a fixed, seeded split, so it never depends on
    the layout. At least one validation sample when val_fraction > 0."""
    n_val = int(round(num_samples * val_fraction))
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    if num_samples - n_val < 1:
        from raymp.data.corpus import DataError

        raise DataError(f"data.val_fraction {val_fraction} leaves no training samples of {num_samples}")
    perm = np.random.default_rng(seed).permutation(num_samples)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class GlobalOrder:
    """Positions 0, 1, 2, ... of the endless order over `num_samples` training samples."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._perm_epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def take(self, start: int, count: int) -> np.ndarray:
        """Training-sample indices at order positions [start, start + count); a batch that
        crosses an epoch boundary ends one epoch and starts the next."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(start + filled, self.num_samples)
            n = min(count - filled, self.num_samples - offset)
            out[filled:filled + n] = self.permutation(epoch)[offset:offset + n]
            filled += n
        return out


class TrainOrder:
    """Which sample ids (rows of the packed dataset) each step reads."""

    def __init__(self, num_samples: int, val_fraction: float, seed: int, global_batch: int):
        self.train_ids, self.val_ids = split_ids(num_samples, val_fraction, seed)
        if global_batch > len(self.train_ids):
            raise ValueError(
                f"train.global_batch_size ({global_batch}) exceeds the {len(self.train_ids)} training "
                "samples; use a smaller batch or more data"
            )
        self.global_batch = global_batch
        self.order = GlobalOrder(len(self.train_ids), seed)

    def sample_ids(self, consumed: int, count: int) -> np.ndarray:
        return self.train_ids[self.order.take(consumed, count)]

    def consumed_before(self, step: int, start: "DataPosition | None" = None) -> int:
        """Samples consumed before `step` (counted from `start`, if the run was resumed)."""
        base_step, base = (start.step, start.consumed) if start else (0, 0)
        return base + (step - base_step) * self.global_batch

    def batch(self, step: int, start: "DataPosition | None" = None) -> np.ndarray:
        """The global batch of `step` (counted from `start`, if the run was resumed)."""
        return self.sample_ids(self.consumed_before(step, start), self.global_batch)


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its data: saved with a checkpoint, given back to resume exactly."""

    step: int  # optimizer steps done
    consumed: int  # samples consumed: position in the global order
    epoch: int
    offset: int  # position within the epoch
    num_train_samples: int
    seed: int
    dataset: str  # the prepared dataset's fingerprint + tokenizer + seq_len

    @classmethod
    def at(cls, step: int, consumed: int, order: TrainOrder, seed: int, dataset: str) -> "DataPosition":
        epoch, offset = divmod(consumed, len(order.train_ids))
        return cls(step, consumed, epoch, offset, len(order.train_ids), seed, dataset)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(**d)

    def check_compatible(self, order: TrainOrder, seed: int, dataset: str) -> None:
        """Resuming into another dataset or seed would silently read other samples: refuse."""
        problems = []
        if self.dataset != dataset:
            problems.append(f"dataset {self.dataset} (now {dataset})")
        if self.seed != seed:
            problems.append(f"seed {self.seed} (now seed={seed})")
        if self.num_train_samples != len(order.train_ids):
            problems.append(f"{self.num_train_samples} training samples (now {len(order.train_ids)}; "
                            "data.val_fraction changed?)")
        if problems:
            raise ValueError("cannot resume the data position: it was saved with " + "; ".join(problems)
                             + ". Use the same data.source, data.tokenizer, train.seq_len, seed and "
                             "data.val_fraction")


def replica_slice(batch: np.ndarray, local_batch: int, replica: int) -> np.ndarray:
    """Replica r's contiguous share of a global batch: `local_batch` rows (Layout.local_batch)."""
    return batch[replica * local_batch : (replica + 1) * local_batch]
