// Paged prefill attention for the CPU, called from XLA through its FFI (see attention.py).
//
// A chunk of queries per row, causal over the row's pages. The plain-XLA block walk gathers
// every block of pages into a copy, scores the whole chunk against it and masks afterwards;
// this kernel reads the keys and values in place and scores each query only against the keys
// it may see:
//
//   row b, queries c0 .. c0+15 (one item per KV head), positions p_c:
//     keys 0 .. p_c of each, read once for the 16 queries and their group's query heads
//     (with a window w: keys p_c - w + 1 .. p_c of each, read from the first's on)
//
// Contract (as pallas_kernels.reference.prefill_attention_ref), float32 throughout but the pool:
//   q          [B, C, H, D]      a chunk of C queries per row
//   k, v       [P, page, KV, D]  the page pool, the chunk's own keys and values written: float32,
//                                bfloat16 as uint16 bits (the ...Bf16 handlers) or
//                                float8_e4m3fn as uint8 bytes (the ...Fp8 handlers)
//   page_table [B, pages_per_seq] int32
//   positions  [B, C] int32       query (b, c) sees keys j <= positions[b, c]
//   seq_lens   [B] int32          keys the row holds, chunk included
//   out        [B, C, H, D]
//   scale, and sliding_window and soft_cap where set (AttentionOptions, cpu_kernels.h)
// A query at a position >= seq_lens[b] is padding (the reference gives garbage there that
// callers ignore): its output is zeros, and so is every query of a row with seq_lens 0, and of
// a query whose window lies past its row's table.
// A row reads at most pages_per_seq * page tokens; page ids outside [0, P) read page 0. With a
// window, an item reads no key before its first query's window: the pages wholly before it are
// never touched (the engine may have freed them).
//
// The ragged form (JaxserveCpuPrefillAttentionRagged) packs the rows' chunks one after another
// with no padding between them, as the engine's ragged prefill call does:
//   q          [T, H, D]         row b's queries are tokens query_starts[b] .. query_starts[b+1]-1
//   positions  [T] int32
//   query_starts [B + 1] int32   nondecreasing, query_starts[B] <= T
//   out        [T, H, D]         tokens past query_starts[B] (padding) give zeros
// Each query is computed as in the padded form, to the same bits; a row of one query at its
// sequence's end (a decode row in a mixed call) runs as the decode kernel's slot.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace jaxserve_cpu;

constexpr int64_t kQueries = 16;  // queries of a row per work item

template <class T>  // the pool's element: float, bf16_bits or fp8_e4m3
struct Problem {
  const float* q;  // [tokens, heads, head_dim]: the padded form's [B, C] flattened
  const T* k;
  const T* v;
  const int32_t* page_table;
  const int32_t* positions;  // [tokens]
  const int32_t* seq_lens;
  float* out;
  int64_t rows, heads, head_dim, pages, page_size, kv_heads, pages_per_seq;
  AttentionOptions options;
};

// Queries [c0, c0 + kQueries) of the `count` from token `first` on, which are `row`'s, the
// query heads of KV head `kv`, against keys [lo, hi), those any of them sees. Query vector i is
// query c0 + i / group, head kv * group + i % group; scores[i * len + j - lo] its score for key j.
template <class T>
void attend(const Problem<T>& p, int64_t row, int64_t first, int64_t count, int64_t kv, int64_t c0,
            std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads, dim = p.head_dim;
  const int64_t c1 = std::min(c0 + kQueries, count);
  const int64_t held = std::min<int64_t>(std::max(p.seq_lens[row], 0),
                                         p.pages_per_seq * p.page_size);
  const int32_t* positions = p.positions + first;
  auto keys_seen = [&](int64_t c) {  // the end of the keys query c sees; 0 for padding
    const int64_t pos = positions[c];
    return pos < 0 || pos >= p.seq_lens[row] ? int64_t{0} : std::min(pos + 1, held);
  };
  auto first_seen = [&](int64_t c) { return p.options.first_key(positions[c]); };
  auto q_at = [&](int64_t i) {
    return p.q + (((first + c0 + i / group) * p.heads) + kv * group + i % group) * dim;
  };
  auto out_at = [&](int64_t i) {
    return p.out + (((first + c0 + i / group) * p.heads) + kv * group + i % group) * dim;
  };
  const int64_t nq = (c1 - c0) * group;
  int64_t lo = INT64_MAX, hi = 0;  // the keys any query of the item sees
  for (int64_t c = c0; c < c1; ++c) {
    if (first_seen(c) >= keys_seen(c)) continue;
    lo = std::min(lo, first_seen(c));
    hi = std::max(hi, keys_seen(c));
  }
  for (int64_t i = 0; i < nq; ++i) std::fill(out_at(i), out_at(i) + dim, 0.f);
  if (lo >= hi) return;
  const int64_t len = hi - lo;
  const PagedSeq seq{p.page_table + row * p.pages_per_seq, p.pages, p.page_size,
                     p.kv_heads * dim};

  scores.resize(nq * len);
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) {  // scores, 8 keys at a time, each read once for every query
    const T* keys[8];
    for (int j = 0; j < 8; ++j) keys[j] = seq.row(p.k, t + j, kv, dim);
    for (int64_t i = 0; i < nq; ++i) dot8(q_at(i), keys, dim, scores.data() + i * len + t - lo);
  }
  for (; t < hi; ++t) {
    const T* key = seq.row(p.k, t, kv, dim);
    for (int64_t i = 0; i < nq; ++i) scores[i * len + t - lo] = dot1(q_at(i), key, dim);
  }
  // weights, zero outside the keys each query sees (those keys are written: finite)
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t begin = first_seen(c0 + i / group), end = keys_seen(c0 + i / group);
    if (begin >= end) {
      std::fill(scores.data() + i * len, scores.data() + (i + 1) * len, 0.f);
    } else {
      attention_weights(scores.data() + i * len, begin - lo, end - lo, len, p.options);
    }
  }
  t = lo;
  for (; t + 4 <= hi; t += 4) {  // values, 4 at a time: one load and store of each output
    const T* v0 = seq.row(p.v, t, kv, dim);
    const T* v1 = seq.row(p.v, t + 1, kv, dim);
    const T* v2 = seq.row(p.v, t + 2, kv, dim);
    const T* v3 = seq.row(p.v, t + 3, kv, dim);
    for (int64_t i = 0; i < nq; ++i) {
      const float* w = scores.data() + i * len + t - lo;
      if (w[0] == 0.f && w[1] == 0.f && w[2] == 0.f && w[3] == 0.f) continue;  // unseen keys
      add_weighted4(out_at(i), w, v0, v1, v2, v3, dim);
    }
  }
  for (; t < hi; ++t) {
    const T* value = seq.row(p.v, t, kv, dim);
    for (int64_t i = 0; i < nq; ++i) add_weighted(out_at(i), scores[i * len + t - lo], value, dim);
  }
}

using Queries = ffi::BufferR4<ffi::F32>;
using Pool = ffi::BufferR4<ffi::F32>;
using Pool16 = ffi::BufferR4<ffi::U16>;  // bfloat16 bits
using Pool8 = ffi::BufferR4<ffi::U8>;    // float8_e4m3fn bits
using Table = ffi::BufferR2<ffi::S32>;
using Positions = ffi::BufferR2<ffi::S32>;
using Lens = ffi::BufferR1<ffi::S32>;
using Out = ffi::ResultBufferR4<ffi::F32>;
using PackedQueries = ffi::BufferR3<ffi::F32>;
using PackedPositions = ffi::BufferR1<ffi::S32>;
using PackedOut = ffi::ResultBufferR3<ffi::F32>;

template <class T>
bool consistent(const Problem<T>& p, const ffi::Span<const int64_t>& kd,
                const ffi::Span<const int64_t>& vd, const ffi::Span<const int64_t>& td,
                int64_t lens) {
  return kd[3] == p.head_dim && p.kv_heads > 0 && p.heads % p.kv_heads == 0 &&
         std::equal(kd.begin(), kd.end(), vd.begin()) && td[0] == p.rows && lens == p.rows;
}

template <class PoolBuffer>  // Pool, Pool16 or Pool8
ffi::Error PrefillAttention(ffi::ThreadPool pool, Queries q, PoolBuffer k, PoolBuffer v,
                            Table page_table, Positions positions, Lens seq_lens, Out out,
                            ffi::Dictionary attrs) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto pd = positions.dimensions();
  Problem<PoolElement<PoolBuffer>> p{
      q.typed_data(), pool_data(k), pool_data(v), page_table.typed_data(),
      positions.typed_data(), seq_lens.typed_data(), out->typed_data(),
      qd[0], qd[2], qd[3], kd[0], kd[1], kd[2], page_table.dimensions()[1], {}};
  if (ffi::Error e = read_options(attrs, p.options); e.failure()) return e;
  const int64_t chunk = qd[1];
  if (!consistent(p, kd, v.dimensions(), page_table.dimensions(), seq_lens.dimensions()[0]) ||
      pd[0] != p.rows || pd[1] != chunk) {
    return ffi::Error::InvalidArgument("cpu prefill attention: inconsistent shapes");
  }
  const int64_t blocks = (chunk + kQueries - 1) / kQueries;
  // items: (row, KV head, block of queries), each row's last and longest block first
  parallel_items(pool, p.rows * p.kv_heads * blocks,
                 [p, blocks, chunk](int64_t i, std::vector<float>& scores) {
                   const int64_t block = blocks - 1 - i % blocks, rest = i / blocks;
                   const int64_t row = rest / p.kv_heads;
                   attend(p, row, row * chunk, chunk, rest % p.kv_heads, block * kQueries,
                          scores);
                 });
  return ffi::Error::Success();
}

template <class PoolBuffer>  // Pool, Pool16 or Pool8
ffi::Error PrefillAttentionRagged(ffi::ThreadPool pool, PackedQueries q, PoolBuffer k,
                                  PoolBuffer v, Table page_table, PackedPositions positions,
                                  Lens query_starts, Lens seq_lens, PackedOut out,
                                  ffi::Dictionary attrs) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  Problem<PoolElement<PoolBuffer>> p{
      q.typed_data(), pool_data(k), pool_data(v), page_table.typed_data(),
      positions.typed_data(), seq_lens.typed_data(), out->typed_data(),
      seq_lens.dimensions()[0], qd[1], qd[2], kd[0], kd[1], kd[2],
      page_table.dimensions()[1], {}};
  if (ffi::Error e = read_options(attrs, p.options); e.failure()) return e;
  const int64_t tokens = qd[0];
  if (!consistent(p, kd, v.dimensions(), page_table.dimensions(), p.rows) ||
      positions.dimensions()[0] != tokens || query_starts.dimensions()[0] != p.rows + 1) {
    return ffi::Error::InvalidArgument("cpu ragged prefill attention: inconsistent shapes");
  }
  const int32_t* starts = query_starts.typed_data();
  if (starts[0] < 0 || starts[p.rows] > tokens) {
    return ffi::Error::InvalidArgument("cpu ragged prefill attention: query_starts outside q");
  }
  for (int64_t b = 0; b < p.rows; ++b) {
    if (starts[b + 1] < starts[b]) {
      return ffi::Error::InvalidArgument("cpu ragged prefill attention: query_starts decrease");
    }
  }
  const int64_t used = starts[p.rows], width = p.heads * p.head_dim;
  std::fill(p.out + used * width, p.out + tokens * width, 0.f);  // the call's padding tokens
  // items: (row, block of queries, KV head), each row's last and longest block first; a row of
  // one query at its sequence's end (a decode row) is one item, the decode kernel's slot
  struct Item {
    int32_t row, c0, kv;  // kv -1: a decode row, all KV heads
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < p.rows; ++b) {
    const int32_t row = static_cast<int32_t>(b), count = starts[b + 1] - starts[b];
    if (count == 1 && p.positions[starts[b]] == p.seq_lens[b] - 1) {
      items.push_back({row, 0, -1});
      continue;
    }
    for (int32_t c0 = (count - 1) / kQueries * kQueries; c0 >= 0; c0 -= kQueries) {
      for (int32_t kv = 0; kv < p.kv_heads; ++kv) items.push_back({row, c0, kv});
    }
  }
  const int64_t total = static_cast<int64_t>(items.size());
  parallel_items(pool, total,
                 [p, items = std::move(items), starts](int64_t i, std::vector<float>& scores) {
                   const Item item = items[i];
                   if (item.kv < 0) {
                     const int64_t at = starts[item.row] * p.heads * p.head_dim;
                     decode_query(p.q + at, p.k, p.v,
                                  p.page_table + item.row * p.pages_per_seq,
                                  p.seq_lens[item.row], p.out + at, p.heads, p.head_dim,
                                  p.pages, p.page_size, p.kv_heads, p.pages_per_seq,
                                  p.options, scores);
                     return;
                   }
                   attend(p, item.row, starts[item.row], starts[item.row + 1] - starts[item.row],
                          item.kv, item.c0, scores);
                 });
  return ffi::Error::Success();
}

// the handlers' signatures, on a pool of any kind
#define JAXSERVE_PREFILL_BINDING(PoolBuffer) \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<Queries>()                        \
      .Arg<PoolBuffer>()                     \
      .Arg<PoolBuffer>()                     \
      .Arg<Table>()                          \
      .Arg<Positions>()                      \
      .Arg<Lens>()                           \
      .Ret<Queries>()                        \
      .Attrs()

#define JAXSERVE_RAGGED_BINDING(PoolBuffer) \
  ffi::Ffi::Bind()                          \
      .Ctx<ffi::ThreadPool>()               \
      .Arg<PackedQueries>()                 \
      .Arg<PoolBuffer>()                    \
      .Arg<PoolBuffer>()                    \
      .Arg<Table>()                         \
      .Arg<PackedPositions>()               \
      .Arg<Lens>()                          \
      .Arg<Lens>()                          \
      .Ret<PackedQueries>()                 \
      .Attrs()

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttentionRagged, PrefillAttentionRagged<Pool>,
                              JAXSERVE_RAGGED_BINDING(Pool));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttentionRaggedBf16,
                              PrefillAttentionRagged<Pool16>, JAXSERVE_RAGGED_BINDING(Pool16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttention, PrefillAttention<Pool>,
                              JAXSERVE_PREFILL_BINDING(Pool));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttentionBf16, PrefillAttention<Pool16>,
                              JAXSERVE_PREFILL_BINDING(Pool16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttentionRaggedFp8,
                              PrefillAttentionRagged<Pool8>, JAXSERVE_RAGGED_BINDING(Pool8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuPrefillAttentionFp8, PrefillAttention<Pool8>,
                              JAXSERVE_PREFILL_BINDING(Pool8));
