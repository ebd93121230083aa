"""Token bitmasks: a [V] set of allowed tokens as ceil(V / 32) int32 words, bit i of word w for
token 32 * w + i (the layout the device's sampler unpacks and llguidance fills). A leaf: numpy only."""

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """[V] bool -> [ceil(V / 32)] int32 bitmask."""
    words = np.zeros((bitmask_width(allowed.shape[0]) * 32,), bool)
    words[:allowed.shape[0]] = allowed
    bits = np.packbits(words.reshape(-1, 32)[:, ::-1], axis=1)  # big-endian bytes, bit 31 first
    return bits.view(">u4")[:, 0].astype(np.uint32).view(np.int32)
