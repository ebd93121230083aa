"""The GPU backend's attention: the Pallas kernels of `pallas_kernels` (Triton on an NVIDIA
GPU; the Pallas interpreter elsewhere, which is how the tests run them on the CPU). Its linear
layers and reductions are XLA's (`base.Ops`)."""

from dataclasses import dataclass

import jax

from jaxserve.backends.base import Attention
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from pallas_kernels import decode_attention, prefill_attention


@dataclass(frozen=True)
class PallasAttention(Attention):
    name = "pallas"
    interpret: bool = False  # run through the Pallas interpreter (any platform; slow)

    def padded(self, q: jax.Array, kv: KVCache, md: AttentionMetadata, scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
        k_pool, v_pool = kv.pools
        window = dict(sliding_window=sliding_window, soft_cap=soft_cap)
        if q.shape[1] == 1:
            return decode_attention(q[:, 0], k_pool, v_pool, md.page_table, md.seq_lens, scale,
                                    interpret=self.interpret, **window)[:, None]
        return prefill_attention(q, k_pool, v_pool, md.page_table, md.positions, md.seq_lens,
                                 scale, interpret=self.interpret, **window)
