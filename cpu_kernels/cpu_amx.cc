// The linear layers' matmul on AMX tiles, in three bf16 passes (bf16x3, what JAX calls
// Precision.HIGH), called from XLA through its FFI (see cpu_matmul.py).
//
//   out[M, N] = x[M, K] @ w[K, N]   float32 in and out; K a multiple of 32
//
// Each float32 operand splits into a bf16 high part and a bf16 low part (the rounding rest of
// the high one, itself rounded): x = xh + xl, w = wh + wl, each within 2^-17 of its value. A
// tile product sums pairs of exact bf16 products into float32, so
//
//   x w ~ xh wh + xh wl + xl wh          (the dropped xl wl is below 2^-16 of the product)
//
// is three tile products per step of k instead of one: within about 1e-5 of the float32 dot,
// not its bits. On a CPU with AMX-BF16 one tile product does 16 x 16 x 32 multiply-adds, and
// measured about 7x a core's float32 FMA rate, so the three still run faster than float32.
//
// Batch invariance holds as in cpu_matmul.cc: an output element is one chain of tile products
// over k in order, computed the same way for every row of every tile (the rows of a partial
// tile are zeros), so a row's result does not depend on M or on where the row sits.
//
// w arrives packed by `pack_amx` (cpu_matmul.py): [2, ceil(N / 16), K / 2, 32] bf16, the high
// parts then the low ones; in block b, row r holds columns 16 b .. 16 b + 15 of w's rows 2 r and
// 2 r + 1 interleaved (w[2r, c], w[2r + 1, c] for each column c, zero past N): the pair layout
// the tile product reads for its second operand, so a tile of 16 such rows (32 of k) is 1 KiB in
// one run.
//
// x's parts are made each call in a tile layout too: [2, rows / 16, K / 32, 16, 32] bf16
// (`split`), a tile of 16 rows by 32 of k 1 KiB in one run. Loaded from x's own row order
// instead (a stride of 2 K bytes), a 32-row block's tiles fall into a few of L1's sets.
//
// Tiles (eight there are): two 16-row blocks of x against two column blocks of w, or one
// against two where fewer rows are left (rows32, rows16). A full block of results is stored
// from its tiles straight into `out`; a partial one (past m or n) through a staging copy.
// The tile layout of x and the direct stores together, against x's rows and a staging copy of
// every block: 1.35-1.5x on one core (M 1024; K x N 512 x 512, 512 x 1024, 1024 x 512), the
// layout alone about 1.15x.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace jaxserve_cpu;

#if defined(JAXSERVE_AMX)

constexpr int64_t kRowsPerItem = 128;  // rows of x per work item (8 blocks of 16)

// Linux hands out the tile registers' state only to a process that asks (arch_prctl), once.
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes: 16 x 16 float32 results, 16 x 32 bf16 operands.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Elements of x's parts from row `row`'s tile row at step k0 of k on (row a multiple of 16
// for a tile's start): tiles of [16 rows, 32 of k], 1 KiB each, a row block's steps in order.
inline int64_t tile_at(int64_t row, int64_t k0, int64_t k) {
  return ((row / 16) * (k / 32) + k0 / 32) * 512 + (row % 16) * 32;
}

// x's rows [r0, r1) [.., k] float32 -> high and low bf16 parts in the tiles' layout; rows past
// `rows` (up to r1, padding to a multiple of 16) are zeros.
void split(const float* x, int64_t rows, int64_t r0, int64_t r1, int64_t k, uint16_t* hi,
           uint16_t* lo) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
      const int64_t at = tile_at(r, k0, k);
      if (r >= rows) {
        std::fill(hi + at, hi + at + 32, uint16_t{0});
        std::fill(lo + at, lo + at + 32, uint16_t{0});
        continue;
      }
      const float* src = x + r * k + k0;
      const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
      const __m512bh h = _mm512_cvtne2ps_pbh(b, a);  // elements k0 .. k0 + 31 in order
      const __m512 ha = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)h)), 16));
      const __m512 hb = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)h, 1)), 16));
      const __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
      _mm512_storeu_si512(hi + at, (__m512i)h);
      _mm512_storeu_si512(lo + at, (__m512i)l);
    }
  }
}

struct Problem {
  const uint16_t* xh;  // [padded rows / 16, k / 32, 16, 32]: tiles (split)
  const uint16_t* xl;
  const uint16_t* w;  // [2, blocks, k / 2, 32]
  float* out;         // [m, n]
  int64_t m, k, n, blocks;
};

// Stores tiles t and t + 1 (t + 1 when cols is 32), the results for out's rows [row, row + 16)
// x columns [col, col + cols): straight into out when all of them exist, else through `stage`
// (16 x 32 float32) as far as they exist.
void store(const Problem& p, int t, float* stage, int64_t row, int64_t col, int64_t cols) {
  const bool two = cols == 32;
  if (row + 16 <= p.m && col + cols <= p.n) {
    float* at = p.out + row * p.n + col;
    const int64_t stride = p.n * static_cast<int64_t>(sizeof(float));
    if (t == 0) {  // the tile ids are immediates
      _tile_stored(0, at, stride);
      if (two) _tile_stored(1, at + 16, stride);
    } else {
      _tile_stored(2, at, stride);
      if (two) _tile_stored(3, at + 16, stride);
    }
    return;
  }
  if (t == 0) {
    _tile_stored(0, stage, 128);
    if (two) _tile_stored(1, stage + 16, 128);
  } else {
    _tile_stored(2, stage, 128);
    if (two) _tile_stored(3, stage + 16, 128);
  }
  const int64_t rows = std::min<int64_t>(16, p.m - row);
  cols = std::min(cols, p.n - col);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(p.out + (row + r) * p.n + col, stage + r * 32, cols * sizeof(float));
  }
}

// Every output element takes, per step of k, xh wh, then xh wl, then xl wh: the same chain in
// both tile walks below, so a row's bits do not depend on which one computed it.

// Rows [row, row + 16) x column blocks b and b + 1 (b + 1 < blocks when kTwo). The lines of w
// `kAheadSteps` steps of k on are prefetched: with one row block, w streams from memory.
constexpr int64_t kAheadSteps = 4;

template <bool kTwo>
void rows16(const Problem& p, int64_t row, int64_t b, float* stage) {
  const uint16_t* ah = p.xh + tile_at(row, 0, p.k);  // step k0's tile: + k0 * 16
  const uint16_t* al = p.xl + tile_at(row, 0, p.k);
  const int64_t part = p.blocks * (p.k / 2) * 32;  // elements from the high parts to the low
  const uint16_t* b0 = p.w + b * (p.k / 2) * 32;
  const uint16_t* b1 = b0 + (p.k / 2) * 32;
  _tile_zero(0);
  if constexpr (kTwo) _tile_zero(1);
  for (int64_t k0 = 0; k0 < p.k; k0 += 32) {
    const int64_t at = (k0 / 2) * 32;  // row k0 / 2 of a block's pairs
    if (k0 + 32 * kAheadSteps < p.k) {
      const int64_t ahead = at + 16 * kAheadSteps * 32;
      for (int64_t line = 0; line < 1024; line += 64) {  // a tile: 1 KiB
        const char* base = reinterpret_cast<const char*>(b0 + ahead) + line;
        _mm_prefetch(base, _MM_HINT_T0);
        _mm_prefetch(base + 2 * part, _MM_HINT_T0);
        if constexpr (kTwo) {
          _mm_prefetch(base + 2 * (p.k / 2) * 32, _MM_HINT_T0);
          _mm_prefetch(base + 2 * (p.k / 2) * 32 + 2 * part, _MM_HINT_T0);
        }
      }
    }
    _tile_loadd(2, ah + k0 * 16, 64);
    _tile_loadd(3, al + k0 * 16, 64);
    _tile_loadd(4, b0 + at, 64);
    _tile_loadd(5, b0 + part + at, 64);
    if constexpr (kTwo) {
      _tile_loadd(6, b1 + at, 64);
      _tile_loadd(7, b1 + part + at, 64);
    }
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (kTwo) _tile_dpbf16ps(1, 2, 6);
    _tile_dpbf16ps(0, 2, 5);
    if constexpr (kTwo) _tile_dpbf16ps(1, 2, 7);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (kTwo) _tile_dpbf16ps(1, 3, 6);
  }
  store(p, 0, stage, row, b * 16, kTwo ? 32 : 16);
}

// Rows [row, row + 32) x column blocks b and b + 1 (both exist): four results, each operand
// tile used twice, in three passes per step of k (the tiles hold the high parts of x and w,
// then w's low parts, then x's low parts and w's high ones again).
void rows32(const Problem& p, int64_t row, int64_t b, float* stage) {
  const uint16_t* a0h = p.xh + tile_at(row, 0, p.k);
  const uint16_t* a0l = p.xl + tile_at(row, 0, p.k);
  const uint16_t* a1h = a0h + 16 * p.k;  // the next row block's tiles
  const uint16_t* a1l = a0l + 16 * p.k;
  const int64_t part = p.blocks * (p.k / 2) * 32;
  const uint16_t* b0 = p.w + b * (p.k / 2) * 32;
  const uint16_t* b1 = b0 + (p.k / 2) * 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
#define JAXSERVE_FOUR()    \
  _tile_dpbf16ps(0, 4, 6); \
  _tile_dpbf16ps(1, 4, 7); \
  _tile_dpbf16ps(2, 5, 6); \
  _tile_dpbf16ps(3, 5, 7);
  for (int64_t k0 = 0; k0 < p.k; k0 += 32) {
    const int64_t at = (k0 / 2) * 32;
    _tile_loadd(4, a0h + k0 * 16, 64);
    _tile_loadd(5, a1h + k0 * 16, 64);
    _tile_loadd(6, b0 + at, 64);
    _tile_loadd(7, b1 + at, 64);
    JAXSERVE_FOUR()  // xh wh
    _tile_loadd(6, b0 + part + at, 64);
    _tile_loadd(7, b1 + part + at, 64);
    JAXSERVE_FOUR()  // xh wl
    _tile_loadd(4, a0l + k0 * 16, 64);
    _tile_loadd(5, a1l + k0 * 16, 64);
    _tile_loadd(6, b0 + at, 64);
    _tile_loadd(7, b1 + at, 64);
    JAXSERVE_FOUR()  // xl wh
  }
#undef JAXSERVE_FOUR
  store(p, 0, stage, row, b * 16, 32);
  store(p, 2, stage, row + 16, b * 16, 32);
}

using Matrix = ffi::BufferR2<ffi::F32>;
using Packed = ffi::BufferR4<ffi::BF16>;
using Out = ffi::ResultBufferR2<ffi::F32>;

ffi::Error MatmulAmx(ffi::ThreadPool pool, Matrix x, Packed w, Out out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  const int64_t m = xd[0], k = xd[1], n = od[1];
  if (k % 32 != 0 || wd[0] != 2 || wd[1] != (n + 15) / 16 || wd[2] * 2 != k || wd[3] != 32 ||
      od[0] != m) {
    return ffi::Error::InvalidArgument("cpu amx matmul: inconsistent shapes");
  }
  if (!tiles_permitted()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable, "cpu amx matmul: no tile state granted");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  // x's parts, made once a call, kRowsPerItem rows an item (a 1,024 x 512 split takes about
  // 0.45 ms on one core: made on the calling thread alone, a fifth of such a call on two
  // cores); the buffer is the calling thread's, kept for its next call
  thread_local std::vector<uint16_t> parts;
  const int64_t padded = (m + 15) / 16 * 16;
  parts.resize(2 * padded * k);
  const Problem p{parts.data(), parts.data() + padded * k,
                  reinterpret_cast<const uint16_t*>(w.typed_data()), out->typed_data(), m, k, n,
                  wd[1]};
  const int64_t row_items = (m + kRowsPerItem - 1) / kRowsPerItem, pairs = (p.blocks + 1) / 2;
  auto split_item = [xs = x.typed_data(), m, padded, k, hi = parts.data(),
                     lo = parts.data() + padded * k](int64_t i, std::vector<float>&) {
    const int64_t r0 = i * kRowsPerItem;
    split(xs, m, r0, std::min(padded, r0 + kRowsPerItem), k, hi, lo);
  };
  if (row_items == 1) {
    std::vector<float> unused;
    split_item(0, unused);
  } else {
    parallel_items(pool, row_items, split_item);
  }
  parallel_items(pool, row_items * pairs, [p, pairs](int64_t i, std::vector<float>& stage) {
    configure_tiles();  // per thread: the items run on XLA's pool as well as the caller
    stage.resize(16 * 32);
    const int64_t b = (i % pairs) * 2;
    const int64_t end = std::min(p.m, (i / pairs + 1) * kRowsPerItem);
    int64_t row = (i / pairs) * kRowsPerItem;
    if (b + 1 < p.blocks) {
      for (; row + 16 < end; row += 32) rows32(p, row, b, stage.data());
    }
    for (; row < end; row += 16) {
      if (b + 1 < p.blocks) {
        rows16<true>(p, row, b, stage.data());
      } else {
        rows16<false>(p, row, b, stage.data());
      }
    }
    _tile_release();
  });
  return ffi::Error::Success();
}

#else

using Matrix = ffi::BufferR2<ffi::F32>;
using Packed = ffi::BufferR4<ffi::BF16>;
using Out = ffi::ResultBufferR2<ffi::F32>;

ffi::Error MatmulAmx(ffi::ThreadPool, Matrix, Packed, Out) {
  return ffi::Error(ffi::ErrorCode::kUnavailable,
                    "cpu amx matmul: built for a CPU without AMX-BF16 and AVX512-BF16");
}

#endif

}  // namespace

// 1 where this build has the AMX kernel and the process may use the tiles, else 0.
extern "C" int JaxserveCpuAmxReady() {
#if defined(JAXSERVE_AMX)
  return tiles_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuMatmulAmx, MatmulAmx,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Packed>()
                                  .Ret<Matrix>());
