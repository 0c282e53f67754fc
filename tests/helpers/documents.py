"""Packed rows of several documents, each closed by an end-of-text token, for the mask tests."""

from __future__ import annotations

import torch

EOT = 7


def packed_tokens() -> torch.Tensor:
    """Two rows of 32 tokens: three documents in the first, two in the second."""
    tokens = torch.randint(EOT + 1, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[0, 5] = tokens[0, 20] = tokens[1, 12] = EOT
    return tokens


def documents(row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in a row of tokens."""
    ends = [int(i) + 1 for i in (row == EOT).nonzero().flatten()]
    bounds = [0, *ends] + ([] if ends and ends[-1] == len(row) else [len(row)])
    return list(zip(bounds, bounds[1:]))
