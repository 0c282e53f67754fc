"""A tokenizer plugged in by import path (data.tokenizer = 'helpers.plugins:ReversedBytes')."""

from __future__ import annotations

import numpy as np


class ReversedBytes:
    name, vocab_size, eot_id = "reversed-bytes", 256, 0

    def encode(self, text):
        return np.frombuffer(text.encode()[::-1], dtype=np.uint8).astype(np.int32)
