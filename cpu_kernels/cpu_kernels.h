// What the CPU kernels share (cpu_decode.cc, cpu_prefill.cc, cpu_matmul.cc; built together into
// one library by library.py): narrow elements widened to float32 as they load, the paged pool's
// addressing, the attention's vectorised sums and exponential, and work items spread over XLA's
// intra-op thread pool.
//
// The attention kernels read a page pool of float32, of bfloat16 held as its bits (uint16_t) or
// of float8_e4m3fn held as its bytes (uint8_t): XLA on the CPU scatters integers in place, where
// a write into a bfloat16 pool took a thousand times as long. A narrow key or value is widened
// to float32 exactly as it is loaded, and the sums then run as they do over float32 pages: a
// narrow pool gives the bits a float32 pool holding the same (widened) values gives. The matmul
// widens its int8 and float8_e4m3fn weights with the same functions.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu {

namespace ffi = xla::ffi;

using bf16_bits = uint16_t;         // a bfloat16 element: the top half of a float32
enum class fp8_e4m3 : uint8_t {};  // a float8_e4m3fn element's bits

// An element widened to float32, exactly. bfloat16 as the top half of a float32; int8 as is;
// e4m3fn (sign, 4 exponent bits of bias 7, 3 of mantissa) as an integer times 2^-9, never a
// float32 subnormal. XLA runs the kernels with denormals-are-zero set, so the short route
// through float32 bits, (b & 0x80) << 24 | (b & 0x7f) << 20 times 2^120, reads e4m3's
// subnormals as 0; the vector loads below go through float16 instead (its conversion reads
// subnormals whatever DAZ says). NaN (0x7f, 0xff) reads as +-480: neither a quantised weight
// nor a pool written by attention.py's fp8_bits (which clamps to +-448) holds it.
inline float widen(float x) { return x; }
inline float widen(bf16_bits x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(int8_t x) { return x; }
inline float widen(fp8_e4m3 x) {
  const int b = static_cast<uint8_t>(x), e = (b >> 3) & 15, m = b & 7;
  const float magnitude = static_cast<float>(e ? (8 + m) << (e - 1) : m) * 0x1p-9f;
  return b & 0x80 ? -magnitude : magnitude;
}

// Elements [0, 8) (widen8) or [0, 16) (widen16) from p on, widened to float32; they read only
// those elements. As float16, e4m3fn's bits shifted left 7 (the sign kept in bit 15) are the
// value / 2^8.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const bf16_bits* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline __m256 widen8(const fp8_e4m3* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_slli_epi16(b, 7),
                                     _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(0x1p8f));
}
#endif

#if defined(__AVX512F__)
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const bf16_bits* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline __m512 widen16(const fp8_e4m3* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(b, 7),
                                        _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(0x1p8f));
}
#endif

// A pool buffer's element type: float, bf16_bits for ffi::U16, fp8_e4m3 for ffi::U8
template <class T>
struct PoolType {
  using type = T;
};
template <>
struct PoolType<uint8_t> {
  using type = fp8_e4m3;
};
template <class PoolBuffer>
using PoolElement = typename PoolType<std::remove_cv_t<
    std::remove_pointer_t<decltype(std::declval<PoolBuffer&>().typed_data())>>>::type;

// A pool buffer's elements, as PoolElement
template <class PoolBuffer>
const PoolElement<PoolBuffer>* pool_data(PoolBuffer& pool) {
  return reinterpret_cast<const PoolElement<PoolBuffer>*>(pool.typed_data());
}

// One sequence's view of a KV page pool [P, page, KV, D]: a token's keys (or values) for all KV
// heads are one contiguous row of KV * D elements (float, bf16_bits or fp8_e4m3).
struct PagedSeq {
  const int32_t* table;  // the sequence's page_table row
  int64_t pages, page_size, token_stride;

  // Token t's row, from KV head `kv` on; page ids outside [0, pages) read page 0, the null page.
  template <class T>
  const T* row(const T* pool, int64_t t, int64_t kv, int64_t dim) const {
    int64_t page = table[t / page_size];
    if (page < 0 || page >= pages) page = 0;
    return pool + (page * page_size + t % page_size) * token_stride + kv * dim;
  }
};

// The attention kernels compute every score, weight and output of a query the same way
// wherever it falls among the others (in a group of 8 keys or the tail, a chunk's block of
// queries or a decode slot), so a token's attention does not depend on the batch or on how its
// prompt was cut into chunks: dot1 is dot8 on one key, the value sums are one chain of fused
// multiply-adds over the tokens, and the softmax's tail rounds as its vector body. Keys and
// values (K, V) are float, bf16_bits or fp8_e4m3; queries, scores and outputs are float.

template <class K>
inline float dot(const float* a, const K* b, int64_t n) {  // n not a multiple of 8
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum = std::fma(a[i], widen(b[i]), sum);
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[j] = the sum of acc[j]'s eight lanes, for j < 8 (dot8's final reduction)
inline void reduce8(const __m256* acc, float* out) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                      _mm256_permute2f128_ps(s0123, s4567, 0x31)));
}
#endif

#if defined(__AVX512F__)
// dot8's reduction from sixteen lanes: each folded to eight, then reduce8
inline void reduce8_wide(const __m512* wide, float* out) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j)
    acc[j] = _mm256_add_ps(_mm512_castps512_ps256(wide[j]), _mm512_extractf32x8_ps(wide[j], 1));
  reduce8(acc, out);
}
#endif

// q against 8 keys: out[j] = q . keys[j]. Eight independent sums, not one dependent chain per
// key; with AVX-512 (head_dim a multiple of 16) sixteen lanes folded to eight, then as with
// AVX2: eight vector accumulators reduced together.
template <class K>
inline void dot8(const float* q, const K* const* keys, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
      __m512 wide[8];
      for (int j = 0; j < 8; ++j) wide[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < n; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j)
          wide[j] = _mm512_fmadd_ps(qv, widen16(keys[j] + d), wide[j]);
      }
      return reduce8_wide(wide, out);
    }
#endif
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm256_fmadd_ps(qv, widen8(keys[j] + d), acc[j]);
    }
    return reduce8(acc, out);
  }
#endif
  for (int j = 0; j < 8; ++j) out[j] = dot(q, keys[j], n);
}

// dot8 for two queries of one KV head (grouped-query attention): each key is loaded once for
// both, and each query's sums are dot8's, bit for bit.
template <class K>
inline void dot8x2(const float* qa, const float* qb, const K* const* keys, int64_t n,
                   float* out_a, float* out_b) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 wa[8], wb[8];
    for (int j = 0; j < 8; ++j) wa[j] = wb[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      const __m512 qav = _mm512_loadu_ps(qa + d), qbv = _mm512_loadu_ps(qb + d);
      for (int j = 0; j < 8; ++j) {
        const __m512 kv = widen16(keys[j] + d);
        wa[j] = _mm512_fmadd_ps(qav, kv, wa[j]);
        wb[j] = _mm512_fmadd_ps(qbv, kv, wb[j]);
      }
    }
    reduce8_wide(wa, out_a);
    return reduce8_wide(wb, out_b);
  }
#endif
  dot8(qa, keys, n, out_a);
  dot8(qb, keys, n, out_b);
}

// q . key, summed exactly as dot8 sums each of its keys (it is dot8, on one key).
template <class K>
inline float dot1(const float* q, const K* key, int64_t n) {
  const K* keys[8] = {key, key, key, key, key, key, key, key};
  float out[8];
  dot8(q, keys, n, out);
  return out[0];
}

// e^x for x <= 0 in plain arithmetic: 2^(x log2 e) = 2^i * 2^f, f in [0, 1) by a degree-6
// polynomial (relative error 7e-9); below -87 it gives about 1e-38 rather than 0. GCC does not
// vectorise a loop of these (the bit cast), hence the AVX2 twin below.
constexpr float kExpPoly[7] = {2.168343130e-04f, 1.243794637e-03f, 9.679985256e-03f,
                               5.548215028e-02f, 2.402303083e-01f, 6.931469140e-01f, 1.0f};

inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504089f;
  const float i = std::floor(t);
  const float f = t - i;
  float p = kExpPoly[0];
  for (int c = 1; c < 7; ++c) p = std::fma(p, f, kExpPoly[c]);
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.44269504089f));
  const __m256 i = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, i);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int c = 1; c < 7; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[c]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// s[0, n) <- softmax(s * scale) over [0, n); s[n, len) <- 0 (n >= 1).
inline void softmax_prefix(float* s, int64_t n, int64_t len, float scale) {
  int64_t i = 0;
  float m = s[0] * scale, sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vscale = _mm256_set1_ps(scale);
  if (n >= 8) {
    __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8)
      vm = _mm256_max_ps(vm, _mm256_mul_ps(_mm256_loadu_ps(s + i), vscale));
    m = horizontal_max(vm);
  }
  for (; i < n; ++i) m = std::max(m, s[i] * scale);
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive8(_mm256_fmsub_ps(_mm256_loadu_ps(s + i), vscale, vmax));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = horizontal_sum(vsum);
#else
  for (i = 1; i < n; ++i) m = std::max(m, s[i] * scale);
  i = 0;
#endif
  for (; i < n; ++i) {
    s[i] = exp_nonpositive(std::fma(s[i], scale, -m));  // rounded once, as the fmsub above
    sum += s[i];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (i = 0; i < n; ++i) s[i] *= inv;
  std::fill(s + n, s + len, 0.f);
}

// What an attention call sets besides its buffers (its FFI attributes): `scale` always,
// `sliding_window` and `soft_cap` only where the caller set them (attention.py), so a call that
// sets neither is the call a library built before they existed takes (bench's --baseline).
struct AttentionOptions {
  float scale = 1.f;
  int64_t window = 0;    // a query at p sees keys p - window < j <= p; 0: every j <= p
  float soft_cap = 0.f;  // a scaled score x becomes soft_cap * tanh(x / soft_cap); 0: x

  // The first key a query at `position` sees (the keys before it, and their pages, unread)
  int64_t first_key(int64_t position) const {
    return window > 0 ? std::max<int64_t>(position - window + 1, 0) : 0;
  }
};

inline ffi::Error read_options(const ffi::Dictionary& attrs, AttentionOptions& options) {
  const auto scale = attrs.get<float>("scale");
  if (scale.has_error()) return scale.error();
  options.scale = *scale;
  if (attrs.contains("sliding_window")) {
    const auto window = attrs.get<int64_t>("sliding_window");
    if (window.has_error()) return window.error();
    options.window = *window;
  }
  if (attrs.contains("soft_cap")) {
    const auto cap = attrs.get<float>("soft_cap");
    if (cap.has_error()) return cap.error();
    options.soft_cap = *cap;
  }
  if (options.window < 0 || !(options.soft_cap >= 0.f && std::isfinite(options.soft_cap))) {
    return ffi::Error::InvalidArgument("attention: sliding_window or soft_cap out of range");
  }
  return ffi::Error::Success();
}

// s[lo, hi) <- the weights of the keys there: the softmax of their scores times scale (capped
// first, each by std::tanh, with a soft cap); s[0, lo) and s[hi, len) <- 0 (lo < hi). The
// weights depend on s[lo, hi) alone, wherever the window falls in s: a query's weights are the
// same whether it is scored alone (decode) or among others whose keys start before its own.
inline void attention_weights(float* s, int64_t lo, int64_t hi, int64_t len,
                              const AttentionOptions& options) {
  float scale = options.scale;
  if (options.soft_cap > 0.f) {
    const float cap = options.soft_cap;
    for (int64_t i = lo; i < hi; ++i) s[i] = cap * std::tanh(s[i] * scale / cap);
    scale = 1.f;  // s[i] - max, rounded once, as fma(s[i], 1, -max)
  }
  std::fill(s, s + lo, 0.f);
  softmax_prefix(s + lo, hi - lo, len - lo, scale);
}

#if defined(__AVX512F__)
// acc + w[0] x[0] + w[1] x[1] + w[2] x[2] + w[3] x[3], fused multiply-adds in that order
inline __m512 fma_chain4(__m512 acc, const __m512* w, const __m512* x) {
  for (int j = 0; j < 4; ++j) acc = _mm512_fmadd_ps(w[j], x[j], acc);
  return acc;
}
#endif

// o[0, n) += w[0] v0 + w[1] v1 + w[2] v2 + w[3] v3: four value rows into one output.
template <class V>
inline void add_weighted4(float* o, const float* w, const V* v0, const V* v1, const V* v2,
                          const V* v3, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 z[4] = {_mm512_set1_ps(w[0]), _mm512_set1_ps(w[1]), _mm512_set1_ps(w[2]),
                       _mm512_set1_ps(w[3])};
  for (; d + 16 <= n; d += 16) {
    const __m512 x[4] = {widen16(v0 + d), widen16(v1 + d), widen16(v2 + d), widen16(v3 + d)};
    _mm512_storeu_ps(o + d, fma_chain4(_mm512_loadu_ps(o + d), z, x));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 w0 = _mm256_set1_ps(w[0]), w1 = _mm256_set1_ps(w[1]);
  const __m256 w2 = _mm256_set1_ps(w[2]), w3 = _mm256_set1_ps(w[3]);
  for (; d + 8 <= n; d += 8) {
    __m256 acc = _mm256_loadu_ps(o + d);
    acc = _mm256_fmadd_ps(w0, widen8(v0 + d), acc);
    acc = _mm256_fmadd_ps(w1, widen8(v1 + d), acc);
    acc = _mm256_fmadd_ps(w2, widen8(v2 + d), acc);
    acc = _mm256_fmadd_ps(w3, widen8(v3 + d), acc);
    _mm256_storeu_ps(o + d, acc);
  }
#endif
  for (; d < n; ++d) {
    float acc = std::fma(w[0], widen(v0[d]), o[d]);
    acc = std::fma(w[1], widen(v1[d]), acc);
    acc = std::fma(w[2], widen(v2[d]), acc);
    o[d] = std::fma(w[3], widen(v3[d]), acc);
  }
}

// o[0, n) += w v, rounded as add_weighted4 rounds each of its four
template <class V>
inline void add_weighted(float* o, float w, const V* v, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 zv = _mm512_set1_ps(w);
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(o + d, _mm512_fmadd_ps(zv, widen16(v + d), _mm512_loadu_ps(o + d)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wv, widen8(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < n; ++d) o[d] = std::fma(w, widen(v[d]), o[d]);
}

// add_weighted4 into two outputs (two query heads of one KV head) from the same value rows,
// each loaded once: oa += wa . v, ob += wb . v, each rounded exactly as add_weighted4 rounds it.
template <class V>
inline void add_weighted4x2(float* oa, float* ob, const float* wa, const float* wb, const V* v0,
                            const V* v1, const V* v2, const V* v3, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 a[4] = {_mm512_set1_ps(wa[0]), _mm512_set1_ps(wa[1]), _mm512_set1_ps(wa[2]),
                       _mm512_set1_ps(wa[3])};
  const __m512 b[4] = {_mm512_set1_ps(wb[0]), _mm512_set1_ps(wb[1]), _mm512_set1_ps(wb[2]),
                       _mm512_set1_ps(wb[3])};
  for (; d + 16 <= n; d += 16) {
    const __m512 x[4] = {widen16(v0 + d), widen16(v1 + d), widen16(v2 + d), widen16(v3 + d)};
    _mm512_storeu_ps(oa + d, fma_chain4(_mm512_loadu_ps(oa + d), a, x));
    _mm512_storeu_ps(ob + d, fma_chain4(_mm512_loadu_ps(ob + d), b, x));
  }
#endif
  // the rest as add_weighted4 does it after its AVX-512 loop
  add_weighted4(oa + d, wa, v0 + d, v1 + d, v2 + d, v3 + d, n - d);
  add_weighted4(ob + d, wb, v0 + d, v1 + d, v2 + d, v3 + d, n - d);
}

// One decode query: all heads of a token at the end of its sequence (seq_len keys, the last its
// own; only the last `options.window` of them with a window) against the sequence's pages, as the
// decode kernel computes a slot (cpu_decode.cc). The ragged prefill kernel runs its one-token
// rows through it, so a decode row packed among prompt chunks is the decode step's, to its bits
// and its reads.
//   q, out [heads, head_dim]; table the sequence's page_table row of pages_per_seq entries;
//   T float, bf16_bits or fp8_e4m3 (cpu_decode.cc instantiates each)
template <class T>
void decode_query(const float* q, const T* k, const T* v, const int32_t* table,
                  int32_t seq_len, float* out, int64_t heads, int64_t head_dim, int64_t pages,
                  int64_t page_size, int64_t kv_heads, int64_t pages_per_seq,
                  const AttentionOptions& options, std::vector<float>& scores);

// Work items 0 .. total-1, taken in order by the calling thread and by tasks on XLA's pool, each
// with its own scratch vector. A task that starts after the items ran out returns at once; the
// caller waits only for items taken, so it never waits on a task the pool has not started.
// `work(item, scratch)` is copied into state the late tasks share, so it must hold values only.
template <class Work>
void parallel_items(ffi::ThreadPool& pool, int64_t total, Work work) {
  struct Items {
    Items(Work w, int64_t n) : work(std::move(w)), total(n) {}
    void run() {
      std::vector<float> scratch;
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
        work(i, scratch);
        done.fetch_add(1, std::memory_order_release);
      }
    }
    Work work;
    const int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  if (total <= 0) return;
  auto items = std::make_shared<Items>(std::move(work), total);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([items] { items->run(); });
  items->run();
  while (items->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxserve_cpu
