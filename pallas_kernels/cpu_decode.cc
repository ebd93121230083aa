// Paged decode attention for the CPU, called from XLA through its FFI (see cpu_decode.py).
//
// XLA on the CPU materialises every gather of KV pages before the dot that reads it, so the
// plain-XLA block walk reads each key and value twice and writes it once. This kernel reads
// them in place, once: for each (slot, KV head) it scores the slot's keys page by page, takes
// the softmax over them, then sums the values, on XLA's own intra-op thread pool.
//
// Contract (as pallas_kernels.reference.decode_attention_ref), float32 throughout:
//   q          [S, H, D]         one query per slot
//   k, v       [P, page, KV, D]  the page pool (page 0 is the null page)
//   page_table [S, pages_per_seq] int32
//   seq_lens   [S] int32          0: an empty slot, whose output is zeros
//   out        [S, H, D]
// A slot reads at most pages_per_seq * page tokens; page ids outside [0, P) read page 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* page_table;
  const int32_t* seq_lens;
  float* out;
  int64_t slots, heads, head_dim, pages, page_size, kv_heads, pages_per_seq;
  float scale;
};

constexpr int64_t kAhead = 16;  // tokens to prefetch ahead

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// q against 8 keys: out[j] = q . keys[j]. Eight independent sums, not one dependent chain per
// key; with AVX2, eight vector accumulators reduced together.
inline void dot8(const float* q, const float* const* keys, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + d), acc[j]);
    }
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                        _mm256_permute2f128_ps(s0123, s4567, 0x31)));
    return;
  }
#endif
  for (int j = 0; j < 8; ++j) out[j] = dot(q, keys[j], n);
}

// e^x for x <= 0 in plain arithmetic, so that a loop of them vectorises (libm's expf does not
// without -ffast-math): 2^(x log2 e) = 2^i * 2^f, f in [0, 1) by a degree-6 polynomial
// (relative error 7e-9); below -87 it gives about 1e-38 rather than 0.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504089f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = 2.168343130e-04f;
  p = p * f + 1.243794637e-03f;
  p = p * f + 9.679985256e-03f;
  p = p * f + 5.548215028e-02f;
  p = p * f + 2.402303083e-01f;
  p = p * f + 6.931469140e-01f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One slot's query heads of KV heads [kv_begin, kv_end) against the slot's keys, read in memory
// order (a token's keys for all KV heads are one contiguous row of kv_heads * head_dim floats).
void attend(const Problem& p, int64_t slot, int64_t kv_begin, int64_t kv_end,
            std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t heads = (kv_end - kv_begin) * group;  // query heads [first, first + heads)
  const int64_t first = kv_begin * group;
  const int64_t dim = p.head_dim;
  float* out = p.out + (slot * p.heads + first) * dim;
  std::fill(out, out + heads * dim, 0.f);
  const int64_t len = std::min<int64_t>(std::max(p.seq_lens[slot], 0),
                                        p.pages_per_seq * p.page_size);
  if (len == 0) return;
  const float* q = p.q + (slot * p.heads + first) * dim;
  const int32_t* table = p.page_table + slot * p.pages_per_seq;
  const int64_t token_stride = p.kv_heads * dim;
  auto token_row = [&](const float* pool, int64_t t) {
    int64_t page = table[t / p.page_size];
    if (page < 0 || page >= p.pages) page = 0;
    return pool + (page * p.page_size + t % p.page_size) * token_stride + kv_begin * dim;
  };
  // A page's rows cross the 4 KiB boundaries where the hardware prefetcher stops: fetch the
  // rows kAhead tokens on by hand (the kv heads this item reads: a row's bytes, in lines).
  const int64_t row_bytes = (kv_end - kv_begin) * dim * sizeof(float);
  auto prefetch = [&](const float* pool, int64_t t) {
    if (t >= len) return;
    const char* row = reinterpret_cast<const char*>(token_row(pool, t));
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
  };

  scores.resize(heads * len);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {  // scores, 8 tokens at a time
    const float* rows[8];
    for (int j = 0; j < 8; ++j) {
      prefetch(p.k, t + j + kAhead);
      rows[j] = token_row(p.k, t + j);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* keys[8];
      for (int j = 0; j < 8; ++j) keys[j] = rows[j] + (h / group) * dim;
      dot8(q + h * dim, keys, dim, scores.data() + h * len + t);
    }
  }
  for (; t < len; ++t) {
    const float* row = token_row(p.k, t);
    for (int64_t h = 0; h < heads; ++h)
      scores[h * len + t] = dot(q + h * dim, row + (h / group) * dim, dim);
  }
  for (int64_t h = 0; h < heads; ++h) {  // softmax weights, normalised
    float* s = scores.data() + h * len;
    float m = s[0] * p.scale;
    for (int64_t i = 1; i < len; ++i) m = std::max(m, s[i] * p.scale);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      s[i] = exp_nonpositive(s[i] * p.scale - m);
      sum += s[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
  }
  t = 0;
  for (; t + 4 <= len; t += 4) {  // values, 4 tokens at a time: one load and store of out
    const float* rows[4];
    for (int j = 0; j < 4; ++j) {
      prefetch(p.v, t + j + kAhead);
      rows[j] = token_row(p.v, t + j);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* w = scores.data() + h * len + t;
      const int64_t off = (h / group) * dim;
      const float *v0 = rows[0] + off, *v1 = rows[1] + off, *v2 = rows[2] + off,
                  *v3 = rows[3] + off;
      float* o = out + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d)
        o[d] += w[0] * v0[d] + w[1] * v1[d] + w[2] * v2[d] + w[3] * v3[d];
    }
  }
  for (; t < len; ++t) {
    const float* row = token_row(p.v, t);
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * len + t];
      const float* value = row + (h / group) * dim;
      float* o = out + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += w * value[d];
    }
  }
}

// Work items (a slot, or a slot's KV head when there are too few slots to share among the
// threads) taken in order by the calling thread and by tasks on XLA's pool.
// A task that starts after the items ran out returns at once; the caller waits only for items
// taken, so it never waits on a task the pool has not started.
struct Items {
  Items(const Problem& problem, int64_t splits)
      : p(problem), splits(splits), total(p.slots * splits) {}
  void run() {
    std::vector<float> scores;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const int64_t part = i % splits, per_part = p.kv_heads / splits;
      attend(p, i / splits, part * per_part, (part + 1) * per_part, scores);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  const Problem p;
  const int64_t splits, total;  // splits: parts of a slot's KV heads (1, or kv_heads)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// (aliases: a comma inside the handler macro's arguments would split them)
using Rows = ffi::BufferR3<ffi::F32>;
using Pool = ffi::BufferR4<ffi::F32>;
using Table = ffi::BufferR2<ffi::S32>;
using Lens = ffi::BufferR1<ffi::S32>;
using Out = ffi::ResultBufferR3<ffi::F32>;

ffi::Error DecodeAttention(ffi::ThreadPool pool, Rows q, Pool k, Pool v, Table page_table,
                           Lens seq_lens, Out out, float scale) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto td = page_table.dimensions();
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(), page_table.typed_data(),
            seq_lens.typed_data(), out->typed_data(),
            qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1], scale};
  const auto vd = v.dimensions();
  if (kd[3] != p.head_dim || p.kv_heads == 0 || p.heads % p.kv_heads != 0 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || td[0] != p.slots ||
      seq_lens.dimensions()[0] != p.slots) {
    return ffi::Error::InvalidArgument("cpu decode attention: inconsistent shapes");
  }
  if (p.slots == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  auto items = std::make_shared<Items>(p, p.slots >= 2 * threads ? 1 : p.kv_heads);
  const int64_t helpers = std::min<int64_t>(threads, items->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([items] { items->run(); });
  items->run();
  while (items->done.load(std::memory_order_acquire) < items->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Pool>()
                                  .Arg<Pool>()
                                  .Arg<Table>()
                                  .Arg<Lens>()
                                  .Ret<Rows>()
                                  .Attr<float>("scale"));
