"""The global sample order: step s consumes samples [s*G, (s+1)*G) of a seeded per-epoch permutation.

The order depends only on (seed, dataset size, G), never on dp, so a run resumed with a different
number of replicas consumes exactly the same sequence of samples.
"""

from __future__ import annotations

import numpy as np


class GlobalOrder:
    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if global_batch > num_samples:
            raise ValueError(
                f"train.global_batch_size ({global_batch}) exceeds the {num_samples} training samples; "
                "use a smaller batch or more data"
            )
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self._perm_epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset in that epoch) where step's batch starts. Each epoch yields
        num_samples // G whole batches; the remainder of an epoch is skipped, not wrapped."""
        per_epoch = self.num_samples // self.global_batch
        return step // per_epoch, (step % per_epoch) * self.global_batch

    def batch(self, step: int) -> np.ndarray:
        epoch, offset = self.position(step)
        return self.permutation(epoch)[offset : offset + self.global_batch]


def replica_slice(batch: np.ndarray, dp: int, replica: int) -> np.ndarray:
    """Replica r's contiguous share of a global batch."""
    per = len(batch) // dp
    return batch[replica * per : (replica + 1) * per]
