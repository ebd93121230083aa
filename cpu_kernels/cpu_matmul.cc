// The linear layers' matmul for the CPU, called from XLA through its FFI (see matmul.py).
//
//   out[M, N] = x[M, K] @ w[K, N]    float32, row-major, w as a linear layer stores it
//   out[M, N] = x[M, K] @ w[N, K]^T  the same for a tied LM head (w: the embedding table); each
//                                    block of w is first transposed into the layout above
//   out[M, N] = x[M, K] @ w           w packed as panels[ceil(N / 64), K, 64] (columns 64 p ..
//                                    64 p + 63 of w in panel p, zero past N): what the engine
//                                    stores, so a panel streams from memory in one run where
//                                    the rows of w in place are N floats apart (each in its own
//                                    4 KiB page, where the hardware prefetcher stops)
//   out[M, N] = (x @ w) * scale[N]   w int8 or float8_e4m3fn, in place or as panels, with one
//                                    float32 scale per column (weight-only quantisation):
//                                    each weight widened to float32 exactly as it is loaded,
//                                    the chain as float32's, then one multiply by the column's
//                                    scale; a decode step reads a quarter of float32's bytes
//   out[M, N] = x[M, K] @ w[e]       grouped, for a mixture-of-experts layer: w [E, K, N] (or
//                                    as panels per expert), the rows sorted by expert in groups
//                                    of sizes[E] rows (jax.lax.ragged_dot), each group run as
//                                    its own problem
//
// What XLA's CPU dot does not give a serving engine:
//   - batch invariance: every output element is one chain of fused multiply-adds over
//     k = 0 .. K-1 in order, whatever M is and wherever its row sits, so a request's logits do
//     not depend on how many others share its step (XLA's dot sums a row one way for M = 1,
//     another for M = 2..32 and a third for 48 and 64). Partial columns are masked in `out`
//     (w is read whole: zero past N in a panel, a partial panel in place copied first), and
//     the scalar path std::fma: the same correctly rounded steps, bit for bit;
//   - few rows at the weights' pace: a decode step's handful of rows streams w once, where
//     XLA's dot runs M = 16 at a third of its large-M rate.
//
// Blocking: work items are (a block of kMC rows, a panel of kNC columns), a grouped matmul's
// rows blocked within each group; within one, K in blocks of kKC (the panel of w stays in L2
// while every row tile uses it; partial sums pass through `out` unchanged, so the chain per
// element is the same as one pass), then tiles of up to kMR rows x kNC columns held in
// registers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace jaxserve_cpu;

constexpr int64_t kMR = 6;    // rows per register tile
constexpr int64_t kNC = 64;   // columns per panel: four AVX-512 registers, eight AVX2 ones
constexpr int64_t kKC = 256;  // k per block
constexpr int64_t kMC = 96;   // rows per work item
constexpr int64_t kAhead = 8;  // rows of w to prefetch ahead
// ... as many bytes ahead for a narrower w: 32 rows of int8 (measured 3-9% faster than 8 at
// 1-8 rows)
template <class W>
constexpr int64_t kAheadRows = kAhead * 4 / int64_t{sizeof(W)};

enum class Layout { kRows, kTransposed, kPanels };

struct Problem {
  const float* x;
  const void* w;  // [K, N]; [N, K] when transposed; [ceil(N / kNC), K, kNC] as panels
  const float* scale;  // [N] for an int8 or float8_e4m3fn w; nullptr for a float32 one
  float* out;
  int64_t m, k, n;
  Layout layout;
};

// A share of a panel's next block, fetched into L2 by one of the tiles after a block's first
// (that one waits for the block from memory; the others compute from L2): `lines` cache lines
// from `at` on, `per_k` of them each step of k.
struct Ahead {
  const char* at = nullptr;
  int64_t lines = 0, per_k = 0;
};

// Rows [row, row + R) x columns [col, col + cols) of out (cols <= kNC) over k in [k0, k0 + kc);
// w: row k0 of the panel, rows ldw elements apart; W float, int8_t or fp8_e4m3, widened by
// cpu_kernels.h's widen16 / widen8, a row's kNC columns read whole: a panel always has them
// (zero past N when packed; block() copies a partial panel of w in place into scratch first).
#if defined(__AVX512F__)
// The accumulators are named registers, not an array: GCC keeps an array of 24 vectors in
// memory and stores all of them on every step of k. Inlined into block(), as GCC did by itself
// before the tile took the weight type (out of line, chains of 256 rows measured 2-5% slower).
#define JAXSERVE_ROWS(DO) DO(0) DO(1) DO(2) DO(3) DO(4) DO(5)
template <int R, bool kFetch, class W>
[[gnu::always_inline]] inline void tile(const Problem& p, int64_t row, int64_t col, int64_t cols,
                                        const W* w, int64_t ldw, int64_t k0, int64_t kc,
                                        Ahead next) {
  static_assert(kMR == 6 && kNC == 64, "the register tile is 6 rows x 4 vectors of 16");
  auto lane_mask = [cols](int v) {
    const int64_t left = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    return static_cast<__mmask16>((1u << left) - 1u);
  };
  const __mmask16 m0 = lane_mask(0), m1 = lane_mask(1), m2 = lane_mask(2), m3 = lane_mask(3);
  float* c = p.out + row * p.n + col;
  const float* x = p.x + row * p.k + k0;
#define JAXSERVE_DECLARE(r) __m512 a##r##0, a##r##1, a##r##2, a##r##3;
  JAXSERVE_ROWS(JAXSERVE_DECLARE)
#define JAXSERVE_LOAD(r)                                                              \
  if constexpr (R > r) {                                                              \
    float* cr = c + r * p.n;                                                          \
    a##r##0 = k0 ? _mm512_maskz_loadu_ps(m0, cr) : _mm512_setzero_ps();               \
    a##r##1 = k0 ? _mm512_maskz_loadu_ps(m1, cr + 16) : _mm512_setzero_ps();          \
    a##r##2 = k0 ? _mm512_maskz_loadu_ps(m2, cr + 32) : _mm512_setzero_ps();          \
    a##r##3 = k0 ? _mm512_maskz_loadu_ps(m3, cr + 48) : _mm512_setzero_ps();          \
  }
  JAXSERVE_ROWS(JAXSERVE_LOAD)
  for (int64_t k = 0; k < kc; ++k, w += ldw) {
    // each row of the panel is in another 4 KiB page, where the hardware prefetcher stops
    const char* ahead = reinterpret_cast<const char*>(w + kAheadRows<W> * ldw);
    for (int64_t b = 0; b < kNC * int64_t{sizeof(W)}; b += 64)
      _mm_prefetch(ahead + b, _MM_HINT_T0);
    if constexpr (kFetch) {
      const int64_t end = std::min(next.lines, (k + 1) * next.per_k);
      for (int64_t j = k * next.per_k; j < end; ++j) _mm_prefetch(next.at + 64 * j, _MM_HINT_T1);
    }
    const __m512 w0 = widen16(w), w1 = widen16(w + 16);
    const __m512 w2 = widen16(w + 32), w3 = widen16(w + 48);
#define JAXSERVE_FMA(r)                                                               \
  if constexpr (R > r) {                                                              \
    const __m512 xr = _mm512_set1_ps(x[r * p.k + k]);                                 \
    a##r##0 = _mm512_fmadd_ps(xr, w0, a##r##0);                                       \
    a##r##1 = _mm512_fmadd_ps(xr, w1, a##r##1);                                       \
    a##r##2 = _mm512_fmadd_ps(xr, w2, a##r##2);                                       \
    a##r##3 = _mm512_fmadd_ps(xr, w3, a##r##3);                                       \
  }
    JAXSERVE_ROWS(JAXSERVE_FMA)
  }
#define JAXSERVE_STORE(r)                                                             \
  if constexpr (R > r) {                                                              \
    float* cr = c + r * p.n;                                                          \
    _mm512_mask_storeu_ps(cr, m0, a##r##0);                                           \
    _mm512_mask_storeu_ps(cr + 16, m1, a##r##1);                                      \
    _mm512_mask_storeu_ps(cr + 32, m2, a##r##2);                                      \
    _mm512_mask_storeu_ps(cr + 48, m3, a##r##3);                                      \
  }
  JAXSERVE_ROWS(JAXSERVE_STORE)
#undef JAXSERVE_DECLARE
#undef JAXSERVE_LOAD
#undef JAXSERVE_FMA
#undef JAXSERVE_STORE
#undef JAXSERVE_ROWS
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, bool kFetch, class W>  // (no prefetch of the next block)
void tile(const Problem& p, int64_t row, int64_t col, int64_t cols, const W* w_k0, int64_t ldw,
          int64_t k0, int64_t kc, Ahead) {
  constexpr int V = kNC / 8;  // 8 registers of 8: tiles of R <= 1 row use 8 + 1; rows loop
  __m256i mask[V];
  for (int v = 0; v < V; ++v) {
    const int64_t left = std::clamp<int64_t>(cols - 8 * v, 0, 8);
    alignas(32) int32_t bits[8];
    for (int j = 0; j < 8; ++j) bits[j] = j < left ? -1 : 0;
    mask[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
  }
  // 6 rows x 64 columns do not fit in 16 registers: two rows at a time, w re-read from L1
  for (int r0 = 0; r0 < R; r0 += 2) {
    const int rows = std::min(2, R - r0);
    __m256 acc[2][V];
    float* c = p.out + (row + r0) * p.n + col;
    for (int r = 0; r < rows; ++r)
      for (int v = 0; v < V; ++v)
        acc[r][v] = k0 == 0 ? _mm256_setzero_ps()
                            : _mm256_maskload_ps(c + r * p.n + 8 * v, mask[v]);
    const float* x = p.x + (row + r0) * p.k + k0;
    const W* w = w_k0;
    for (int64_t k = 0; k < kc; ++k, w += ldw) {
      for (int r = 0; r < rows; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * p.k + k]);
        for (int v = 0; v < V; ++v)
          acc[r][v] = _mm256_fmadd_ps(xr, widen8(w + 8 * v), acc[r][v]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int v = 0; v < V; ++v) _mm256_maskstore_ps(c + r * p.n + 8 * v, mask[v], acc[r][v]);
  }
}
#else
template <int R, bool kFetch, class W>
void tile(const Problem& p, int64_t row, int64_t col, int64_t cols, const W* w, int64_t ldw,
          int64_t k0, int64_t kc, Ahead) {
  for (int r = 0; r < R; ++r) {
    float* c = p.out + (row + r) * p.n + col;
    const float* x = p.x + (row + r) * p.k;
    for (int64_t j = 0; j < cols; ++j) {
      float acc = k0 == 0 ? 0.f : c[j];
      for (int64_t k = 0; k < kc; ++k) acc = std::fma(x[k0 + k], widen(w[k * ldw + j]), acc);
      c[j] = acc;
    }
  }
}
#endif

template <bool kFetch, class W>
void tiles(const Problem& p, int64_t row, int64_t rows, int64_t col, int64_t cols, const W* w,
           int64_t ldw, int64_t k0, int64_t kc, Ahead next) {
  switch (rows) {
    case 6: return tile<6, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
    case 5: return tile<5, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
    case 4: return tile<4, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
    case 3: return tile<3, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
    case 2: return tile<2, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
    default: return tile<1, kFetch>(p, row, col, cols, w, ldw, k0, kc, next);
  }
}

// Rows [0, kc) of w's kNC columns at w (rows ldw elements apart), widened into out[kc, kNC]
template <class W>
void widen_rows(const W* w, int64_t ldw, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k, w += ldw, out += kNC) {
#if defined(__AVX512F__)
    _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows<W> * ldw), _MM_HINT_T0);
    for (int64_t j = 0; j < kNC; j += 16) _mm512_storeu_ps(out + j, widen16(w + j));
#elif defined(__AVX2__) && defined(__FMA__)
    _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows<W> * ldw), _MM_HINT_T0);
    for (int64_t j = 0; j < kNC; j += 8) _mm256_storeu_ps(out + j, widen8(w + j));
#else
    for (int64_t j = 0; j < kNC; ++j) out[j] = widen(w[j]);
#endif
  }
}

// Rows [row_begin, row_end) x columns [col, col + cols), on w's elements of type W. w is read
// in place (copying a block of the panel to contiguous memory first measured slower: the
// prefetches keep the rows in place in L1/L2), an int8 or fp8 one widened in each tile's
// registers: int8's block of 16 KiB stays in L1 for the next tile, and measured at least as
// fast as float32 at every M (4-5x at one row, 1.7x at 8; 4096 x 14336 panels). Only fp8 from
// three tiles on is widened once per block into scratch: its widening (five instructions a
// vector) done by every tile cost 15% over float32 at 32-384 rows, done once 2%.
template <class W>
void block(const Problem& p, int64_t row_begin, int64_t row_end, int64_t col, int64_t cols,
           std::vector<float>& scratch) {
  const W* weights = static_cast<const W*>(p.w);
  const bool transposed = p.layout == Layout::kTransposed, panels = p.layout == Layout::kPanels;
  const int64_t count = (row_end - row_begin + kMR - 1) / kMR;  // row tiles
  // The row tiles over k in [k0, k0 + kc) on w (W, or float in scratch) from row k0, rows ldw
  // apart. Panels: a block's first tile waits for the block from memory and the others compute
  // from L2; from three tiles on, the others fetch the panel's next block (next_lines cache
  // lines from `next`) meanwhile, in equal shares (measured: 9-15% off the chain at 16-64 rows,
  // 2-4% at 1,024)
  auto run = [&](const auto* w, int64_t ldw, int64_t k0, int64_t kc, const char* next,
                 int64_t next_lines) {
    const bool fetch = next_lines > 0 && count >= 3;
    const int64_t share = fetch ? (next_lines + count - 2) / (count - 1) : 0;  // lines a tile
    for (int64_t i = 0, row = row_begin; row < row_end; ++i, row += kMR) {
      const int64_t rows = std::min(kMR, row_end - row);
      const int64_t first = (i - 1) * share;  // the tile's first line of the next block
      if (fetch && i > 0 && first < next_lines) {
        const int64_t lines = std::min(share, next_lines - first);
        const Ahead ahead{next + 64 * first, lines, (lines + kc - 1) / kc};
        tiles<true>(p, row, rows, col, cols, w, ldw, k0, kc, ahead);
      } else {
        tiles<false>(p, row, rows, col, cols, w, ldw, k0, kc, {});
      }
    }
  };
  for (int64_t k0 = 0; k0 < p.k; k0 += kKC) {
    const int64_t kc = std::min(kKC, p.k - k0);
    if (transposed || (!panels && cols < kNC)) {
      // w[col + j, k0 + k] (transposed), or a partial panel of w in place w[k0 + k, col + j]
      // (too few columns to read whole), widened -> scratch[k, j]
      const int64_t k_step = transposed ? 1 : p.n, j_step = transposed ? p.k : 1;
      const W* src = transposed ? weights + col * p.k + k0 : weights + k0 * p.n + col;
      scratch.assign(kc * kNC, 0.f);
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t k = 0; k < kc; ++k) scratch[k * kNC + j] = widen(src[k * k_step + j * j_step]);
      run(scratch.data(), kNC, k0, kc, nullptr, 0);
      continue;
    }
    const W* w = panels ? weights + ((col / kNC) * p.k + k0) * kNC : weights + k0 * p.n + col;
    const int64_t ldw = panels ? kNC : p.n;
    const char* next = reinterpret_cast<const char*>(w + kc * kNC);
    const int64_t next_lines =
        panels ? std::min(kKC, p.k - k0 - kc) * kNC * int64_t{sizeof(W)} / 64 : 0;
    if (std::is_same_v<W, fp8_e4m3> && count >= 3) {
      scratch.resize(kKC * kNC);
      widen_rows(w, ldw, kc, scratch.data());
      run(scratch.data(), kNC, k0, kc, next, next_lines);
    } else {
      run(w, ldw, k0, kc, next, next_lines);
    }
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* c = p.out + r * p.n + col;
    if (p.k == 0) std::fill(c, c + cols, 0.f);
    if (p.scale == nullptr) continue;
    for (int64_t j = 0; j < cols; ++j) c[j] *= p.scale[col + j];  // the chain, then its scale
  }
}

// Each problem's rows in blocks of kMC from its own first row, each block times each panel of
// columns a work item (the problems share N: one, or one per expert group of a grouped matmul).
template <class W>
ffi::Error Run(ffi::ThreadPool& pool, std::vector<Problem> problems) {
  struct RowBlock {
    int64_t problem, begin, end;
  };
  std::vector<RowBlock> blocks;
  for (int64_t i = 0; i < static_cast<int64_t>(problems.size()); ++i)
    for (int64_t row = 0; row < problems[i].m; row += kMC)
      blocks.push_back({i, row, std::min(problems[i].m, row + kMC)});
  if (blocks.empty()) return ffi::Error::Success();
  const int64_t n = problems[0].n, panels = (n + kNC - 1) / kNC;
  const int64_t total = static_cast<int64_t>(blocks.size()) * panels;
  parallel_items(pool, total, [problems = std::move(problems), blocks = std::move(blocks), n,
                               panels](int64_t i, std::vector<float>& scratch) {
    const RowBlock& b = blocks[i / panels];
    const int64_t col = (i % panels) * kNC;
    block<W>(problems[b.problem], b.begin, b.end, col, std::min(kNC, n - col), scratch);
  });
  return ffi::Error::Success();
}

using Dims = ffi::Span<const int64_t>;

// Whether w's dimensions in `layout` fit x [M, K] and out [M, N]
bool fits(Dims x, Dims w, Dims out, Layout layout) {
  if (out[0] != x[0]) return false;
  switch (layout) {
    case Layout::kRows: return w.size() == 2 && w[0] == x[1] && w[1] == out[1];
    case Layout::kTransposed: return w.size() == 2 && w[1] == x[1] && w[0] == out[1];
    case Layout::kPanels:
      return w.size() == 3 && w[1] == x[1] && w[2] == kNC && w[0] == (out[1] + kNC - 1) / kNC;
  }
  return false;
}

using Matrix = ffi::BufferR2<ffi::F32>;
using Panels = ffi::BufferR3<ffi::F32>;
using Scale = ffi::BufferR1<ffi::F32>;
using Out = ffi::ResultBufferR2<ffi::F32>;

template <class Weights>
ffi::Error RunFloat(ffi::ThreadPool& pool, Matrix& x, Weights& w, Out& out, Layout layout) {
  if (!fits(x.dimensions(), w.dimensions(), out->dimensions(), layout)) {
    return ffi::Error::InvalidArgument("cpu matmul: inconsistent shapes");
  }
  const auto od = out->dimensions();
  return Run<float>(pool, {{x.typed_data(), w.typed_data(), nullptr, out->typed_data(), od[0],
                            x.dimensions()[1], od[1], layout}});
}

ffi::Error Matmul(ffi::ThreadPool pool, Matrix x, Matrix w, Out out) {
  return RunFloat(pool, x, w, out, Layout::kRows);
}

ffi::Error MatmulTransposed(ffi::ThreadPool pool, Matrix x, Matrix w, Out out) {
  return RunFloat(pool, x, w, out, Layout::kTransposed);
}

ffi::Error MatmulPanels(ffi::ThreadPool pool, Matrix x, Panels w, Out out) {
  return RunFloat(pool, x, w, out, Layout::kPanels);
}

// An int8 or float8_e4m3fn w's kernel, by its buffer's element type
ffi::Error RunQuantised(ffi::ThreadPool& pool, Matrix& x, ffi::AnyBuffer& w, Scale& scale,
                        Out& out, Layout layout) {
  const auto od = out->dimensions();
  if (!fits(x.dimensions(), w.dimensions(), od, layout) || scale.dimensions()[0] != od[1]) {
    return ffi::Error::InvalidArgument("cpu matmul: inconsistent shapes (quantised)");
  }
  const Problem p{x.typed_data(), w.untyped_data(), scale.typed_data(), out->typed_data(),
                  od[0], x.dimensions()[1], od[1], layout};
  switch (w.element_type()) {
    case ffi::DataType::S8: return Run<int8_t>(pool, {p});
    case ffi::DataType::F8E4M3FN: return Run<fp8_e4m3>(pool, {p});
    default: return ffi::Error::InvalidArgument("cpu matmul: w must be int8 or float8_e4m3fn");
  }
}

ffi::Error MatmulQuantised(ffi::ThreadPool pool, Matrix x, ffi::AnyBuffer w, Scale scale,
                           Out out) {
  return RunQuantised(pool, x, w, scale, out, Layout::kRows);
}

ffi::Error MatmulQuantisedPanels(ffi::ThreadPool pool, Matrix x, ffi::AnyBuffer w, Scale scale,
                                 Out out) {
  return RunQuantised(pool, x, w, scale, out, Layout::kPanels);
}

// The grouped (ragged) matmul of a mixture-of-experts layer: x's rows sorted by expert, group e
// the next sizes[e] of them, each multiplied by its expert's w (jax.lax.ragged_dot's meaning):
//
//   x, out [M, *]   | group 0: sizes[0] rows | group 1 | ... | group E-1 | past the total |
//                     @ w[0]                   @ w[1]          @ w[E-1]    zero
//
// A negative size counts as 0, and groups end at row M (a total past M is cut there). Each
// group is its own Problem (x, out and w offset to it), blocked from its first row, so a row
// gets the bits of the matmul above on that row alone with w[e]: the chain per element is the
// same whichever rows, groups or offsets share the call.
using Sizes = ffi::BufferR1<ffi::S32>;
using Experts = ffi::BufferR3<ffi::F32>;       // [E, K, N]
using ExpertPanels = ffi::BufferR4<ffi::F32>;  // [E, ceil(N / kNC), K, kNC]

template <class Weights>
ffi::Error RunGrouped(ffi::ThreadPool& pool, Matrix& x, Weights& w, Sizes& sizes, Out& out,
                      Layout layout) {
  const auto wd = w.dimensions();
  const int64_t experts = wd[0];
  if (!fits(x.dimensions(), wd.last(wd.size() - 1), out->dimensions(), layout) ||
      sizes.dimensions()[0] != experts) {
    return ffi::Error::InvalidArgument("cpu grouped matmul: inconsistent shapes");
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = out->dimensions()[1];
  const int64_t per_expert = experts > 0 ? static_cast<int64_t>(w.element_count()) / experts : 0;
  const int32_t* size = sizes.typed_data();
  std::vector<Problem> groups;
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t end = std::min(m, row + std::max<int64_t>(size[e], 0));
    if (end > row) {
      groups.push_back({x.typed_data() + row * k, w.typed_data() + e * per_expert, nullptr,
                        out->typed_data() + row * n, end - row, k, n, layout});
    }
    row = end;
  }
  std::fill(out->typed_data() + row * n, out->typed_data() + m * n, 0.f);
  return Run<float>(pool, std::move(groups));
}

ffi::Error MatmulGrouped(ffi::ThreadPool pool, Matrix x, Experts w, Sizes sizes, Out out) {
  return RunGrouped(pool, x, w, sizes, out, Layout::kRows);
}

ffi::Error MatmulGroupedPanels(ffi::ThreadPool pool, Matrix x, ExpertPanels w, Sizes sizes,
                               Out out) {
  return RunGrouped(pool, x, w, sizes, out, Layout::kPanels);
}

// out[r] = x[r, 0]^2 + x[r, 1]^2 + ... in index order, each square rounded before its add: the
// bits of the matmul above on (x * x) and a column of ones (its chain of fused multiply-adds
// by 1 is that chain of adds), with no [M, K] array of squares written and read back. Rows run
// eight at a time, eight independent chains; no contraction into fused multiply-adds here.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
void sum_squares(const float* x, int64_t k, int64_t r0, int64_t r1, float* out) {
  constexpr int64_t kRows = 8;
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    float acc[kRows] = {};
    for (int64_t c = 0; c < k; ++c) {
      for (int64_t j = 0; j < kRows; ++j) {
        const float v = x[(r + j) * k + c];
        const float sq = v * v;
        acc[j] = acc[j] + sq;
      }
    }
    std::copy(acc, acc + kRows, out + r);
  }
  for (; r < r1; ++r) {
    float acc = 0.f;
    for (int64_t c = 0; c < k; ++c) {
      const float sq = x[r * k + c] * x[r * k + c];
      acc = acc + sq;
    }
    out[r] = acc;
  }
}
#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC pop_options
#endif

ffi::Error RowSumSquares(ffi::ThreadPool pool, Matrix x, Out out) {
  const auto xd = x.dimensions();
  const auto od = out->dimensions();
  if (od[0] != xd[0] || od[1] != 1) {
    return ffi::Error::InvalidArgument("cpu row sum of squares: inconsistent shapes");
  }
  constexpr int64_t kBlock = 64;  // rows per work item
  const float* data = x.typed_data();
  float* sums = out->typed_data();
  const int64_t m = xd[0], k = xd[1];
  parallel_items(pool, (m + kBlock - 1) / kBlock,
                 [data, sums, m, k](int64_t i, std::vector<float>&) {
                   sum_squares(data, k, i * kBlock, std::min(m, (i + 1) * kBlock), sums);
                 });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuRowSumSquares, RowSumSquares,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulTransposed, MatmulTransposed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulPanels, MatmulPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulQuantised, MatmulQuantised,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scale>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulQuantisedPanels, MatmulQuantisedPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scale>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulGrouped, MatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Experts>()
                                  .Arg<Sizes>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulGroupedPanels, MatmulGroupedPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<ExpertPanels>()
                                  .Arg<Sizes>()
                                  .Ret<Matrix>());
