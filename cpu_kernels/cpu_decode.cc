// Paged decode attention for the CPU, called from XLA through its FFI (see attention.py).
//
// XLA on the CPU materialises every gather of KV pages before the dot that reads it, so the
// plain-XLA block walk reads each key and value twice and writes it once. This kernel reads
// them in place, once: for each (slot, KV head) it scores the slot's keys page by page, takes
// the softmax over them, then sums the values, on XLA's own intra-op thread pool.
//
// Contract (as pallas_kernels.reference.decode_attention_ref), float32 throughout but the pool:
//   q          [S, H, D]         one query per slot
//   k, v       [P, page, KV, D]  the page pool (page 0 is the null page): float32, bfloat16
//                                as uint16 bits (JaxserveCpuDecodeAttentionBf16) or
//                                float8_e4m3fn as uint8 bytes (JaxserveCpuDecodeAttentionFp8)
//   page_table [S, pages_per_seq] int32
//   seq_lens   [S] int32          0: an empty slot, whose output is zeros
//   out        [S, H, D]
//   scale, and sliding_window and soft_cap where set (AttentionOptions, cpu_kernels.h)
// A slot reads at most pages_per_seq * page tokens; page ids outside [0, P) read page 0. With
// a window w a slot reads only its last w keys: the pages before them are never touched (the
// engine may have freed them), and a slot whose window lies past its table gives zeros.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace jaxserve_cpu;

template <class T>  // the pool's element: float, bf16_bits or fp8_e4m3
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* page_table;
  const int32_t* seq_lens;
  float* out;
  int64_t slots, heads, head_dim, pages, page_size, kv_heads, pages_per_seq;
  AttentionOptions options;
};

constexpr int64_t kAhead = 16;  // tokens to prefetch ahead

// One slot's query heads of KV heads [kv_begin, kv_end) against the slot's keys [begin, end),
// read in memory order (a token's keys for all KV heads are one contiguous row of
// kv_heads * head_dim elements); scores[h * len + t - begin] head h's score for key t.
template <class T>
void attend(const Problem<T>& p, int64_t slot, int64_t kv_begin, int64_t kv_end,
            std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t heads = (kv_end - kv_begin) * group;  // query heads [first, first + heads)
  const int64_t first = kv_begin * group;
  const int64_t dim = p.head_dim;
  float* out = p.out + (slot * p.heads + first) * dim;
  std::fill(out, out + heads * dim, 0.f);
  const int64_t seq_len = std::max(p.seq_lens[slot], 0);
  const int64_t end = std::min<int64_t>(seq_len, p.pages_per_seq * p.page_size);
  const int64_t begin = p.options.first_key(seq_len - 1);
  if (begin >= end) return;
  const int64_t len = end - begin;
  const float* q = p.q + (slot * p.heads + first) * dim;
  const PagedSeq seq{p.page_table + slot * p.pages_per_seq, p.pages, p.page_size,
                     p.kv_heads * dim};
  auto token_row = [&](const T* pool, int64_t t) { return seq.row(pool, t, kv_begin, dim); };
  // A page's rows cross the 4 KiB boundaries where the hardware prefetcher stops: fetch the
  // rows kAhead tokens on by hand (the kv heads this item reads: a row's bytes, in lines).
  const int64_t row_bytes = (kv_end - kv_begin) * dim * sizeof(T);
  auto prefetch = [&](const T* pool, int64_t t) {
    if (t >= end) return;
    const char* row = reinterpret_cast<const char*>(token_row(pool, t));
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
  };

  scores.resize(heads * len);
  int64_t t = begin;
  for (; t + 8 <= end; t += 8) {  // scores, 8 tokens at a time
    const T* rows[8];
    for (int j = 0; j < 8; ++j) {
      prefetch(p.k, t + j + kAhead);
      rows[j] = token_row(p.k, t + j);
    }
    for (int64_t h = 0; h < heads;) {  // query heads of one KV head in pairs
      const T* keys[8];
      for (int j = 0; j < 8; ++j) keys[j] = rows[j] + (h / group) * dim;
      float* s = scores.data() + h * len + t - begin;
      if ((h + 1) % group != 0) {
        dot8x2(q + h * dim, q + (h + 1) * dim, keys, dim, s, s + len);
        h += 2;
      } else {
        dot8(q + h * dim, keys, dim, s);
        h += 1;
      }
    }
  }
  for (; t < end; ++t) {
    const T* row = token_row(p.k, t);
    for (int64_t h = 0; h < heads; ++h)
      scores[h * len + t - begin] = dot1(q + h * dim, row + (h / group) * dim, dim);
  }
  for (int64_t h = 0; h < heads; ++h)
    attention_weights(scores.data() + h * len, 0, len, len, p.options);
  t = begin;
  for (; t + 4 <= end; t += 4) {  // values, 4 tokens at a time: one load and store of out
    const T* rows[4];
    for (int j = 0; j < 4; ++j) {
      prefetch(p.v, t + j + kAhead);
      rows[j] = token_row(p.v, t + j);
    }
    for (int64_t h = 0; h < heads;) {
      const float* w = scores.data() + h * len + t - begin;
      const int64_t off = (h / group) * dim;
      if ((h + 1) % group != 0) {
        add_weighted4x2(out + h * dim, out + (h + 1) * dim, w, w + len, rows[0] + off,
                        rows[1] + off, rows[2] + off, rows[3] + off, dim);
        h += 2;
      } else {
        add_weighted4(out + h * dim, w, rows[0] + off, rows[1] + off, rows[2] + off,
                      rows[3] + off, dim);
        h += 1;
      }
    }
  }
  for (; t < end; ++t) {
    const T* row = token_row(p.v, t);
    for (int64_t h = 0; h < heads; ++h) {
      add_weighted(out + h * dim, scores[h * len + t - begin], row + (h / group) * dim, dim);
    }
  }
}

// (aliases: a comma inside the handler macro's arguments would split them)
using Rows = ffi::BufferR3<ffi::F32>;
using Pool = ffi::BufferR4<ffi::F32>;
using Pool16 = ffi::BufferR4<ffi::U16>;  // bfloat16 bits
using Pool8 = ffi::BufferR4<ffi::U8>;    // float8_e4m3fn bits
using Table = ffi::BufferR2<ffi::S32>;
using Lens = ffi::BufferR1<ffi::S32>;
using Out = ffi::ResultBufferR3<ffi::F32>;

template <class PoolBuffer>  // Pool, Pool16 or Pool8
ffi::Error DecodeAttention(ffi::ThreadPool pool, Rows q, PoolBuffer k, PoolBuffer v,
                           Table page_table, Lens seq_lens, Out out, ffi::Dictionary attrs) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto td = page_table.dimensions();
  Problem<PoolElement<PoolBuffer>> p{q.typed_data(), pool_data(k), pool_data(v),
                                     page_table.typed_data(), seq_lens.typed_data(),
                                     out->typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2],
                                     td[1], {}};
  if (ffi::Error e = read_options(attrs, p.options); e.failure()) return e;
  const auto vd = v.dimensions();
  if (kd[3] != p.head_dim || p.kv_heads == 0 || p.heads % p.kv_heads != 0 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || td[0] != p.slots ||
      seq_lens.dimensions()[0] != p.slots) {
    return ffi::Error::InvalidArgument("cpu decode attention: inconsistent shapes");
  }
  if (p.slots == 0) return ffi::Error::Success();
  // a slot per item, or a slot's KV head when there are too few slots to share among the threads
  const int64_t splits = p.slots >= 2 * std::max<int64_t>(pool.num_threads(), 1) ? 1 : p.kv_heads;
  parallel_items(pool, p.slots * splits, [p, splits](int64_t i, std::vector<float>& scores) {
    const int64_t part = i % splits, per_part = p.kv_heads / splits;
    attend(p, i / splits, part * per_part, (part + 1) * per_part, scores);
  });
  return ffi::Error::Success();
}

// the handlers' signature, on a pool of any kind
#define JAXSERVE_DECODE_BINDING(PoolBuffer) \
  ffi::Ffi::Bind()                          \
      .Ctx<ffi::ThreadPool>()               \
      .Arg<Rows>()                          \
      .Arg<PoolBuffer>()                    \
      .Arg<PoolBuffer>()                    \
      .Arg<Table>()                         \
      .Arg<Lens>()                          \
      .Ret<Rows>()                          \
      .Attrs()

}  // namespace

namespace jaxserve_cpu {

template <class T>
void decode_query(const float* q, const T* k, const T* v, const int32_t* table,
                  int32_t seq_len, float* out, int64_t heads, int64_t head_dim, int64_t pages,
                  int64_t page_size, int64_t kv_heads, int64_t pages_per_seq,
                  const AttentionOptions& options, std::vector<float>& scores) {
  const Problem<T> p{q, k, v, table, &seq_len, out, 1, heads, head_dim, pages, page_size,
                     kv_heads, pages_per_seq, options};
  attend(p, 0, 0, kv_heads, scores);
}

template void decode_query<float>(const float*, const float*, const float*, const int32_t*,
                                  int32_t, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, const AttentionOptions&, std::vector<float>&);
template void decode_query<bf16_bits>(const float*, const bf16_bits*, const bf16_bits*,
                                      const int32_t*, int32_t, float*, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, const AttentionOptions&,
                                      std::vector<float>&);
template void decode_query<fp8_e4m3>(const float*, const fp8_e4m3*, const fp8_e4m3*,
                                     const int32_t*, int32_t, float*, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, const AttentionOptions&,
                                     std::vector<float>&);

}  // namespace jaxserve_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttention, DecodeAttention<Pool>,
                              JAXSERVE_DECODE_BINDING(Pool));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttentionBf16, DecodeAttention<Pool16>,
                              JAXSERVE_DECODE_BINDING(Pool16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttentionFp8, DecodeAttention<Pool8>,
                              JAXSERVE_DECODE_BINDING(Pool8));
