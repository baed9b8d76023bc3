// Multi-LoRA delta for CPU decode batches, punica's shrink then expand in one op:
//
//   y[t] += B[slot(t)] (A[slot(t)] x[t])      for every token t with slot(t) >= 0
//
//   y            [T, N]       x's dtype (float32 | bfloat16), last dim contiguous; in place
//   x            [T, K]       float32 | bfloat16, contiguous
//   a_stack      [S, R, K]    float32 | bfloat16, contiguous (R = fused slices x max rank)
//   b_stack      [S, N, R]    a_stack's dtype, contiguous (the LoRA scaling folded in)
//   token_slots  [T]          int64, -1 = no adapter (the row of y is not touched)
//   out_splits   [n] ints     a fused layer's output rows per slice (q, k, v; gate, up), summing
//                             to N, n dividing R: slice i's rows of B use only columns
//                             [i R/n, (i+1) R/n) (the others must be zero), so the expand reads
//                             only those; [] (or one) = every column
//
// The tokens are grouped by slot first, so each adapter's A and B are streamed once per
// group, not once per token. Shrink: per group and block of 8 rows of A, every token of the
// group takes 8 dot products over K (one accumulator each) into a float32 buffer s [T, R].
// Expand, B column-major per slot (LoRALinear's and LoRALogits' stacks): per group and block
// of 16 outputs, an axpy over r (4 tokens per pass share each load of B), reading only the
// block's slice columns (out_splits). B row-major (any other caller): per group and block of
// 8 rows of B, every token takes 8 dot products over R with its s row, reduced together
// (hsum8x8: 7 shuffles for 8 sums). Either way added to y. Work items (group, block) are
// split over torch's OpenMP threads once a pass has enough work to pay for the hand-off.
// Prefill-sized calls (more than kTiledMinTokens tokens) take tiles of tokens
// instead (shrink_tiled, expand_tiled below). Everything accumulates in float32; a bfloat16 y is rounded once after the add.
//
// AVX2 (+FMA, F16C; the avx2 tier and every tier above: AVX-512 builds take the same code):
// 8 lanes, bf16 widened in registers (vec_avx2.h). generic: plain loops the compiler may
// vectorise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "vec_avx2.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kRows = 8;                 // weight rows per block (one accumulator each)
// Multiply-adds of one shrink or expand pass from which it is split over threads, with
// at::parallel_for: the OpenMP threads that run the step's base linears (oneDNN, the
// small-batch kernel) between these passes. A pool of its own (work_pool.h, what this kernel
// used before) kept a worker spinning on the second core while OpenMP's wanted it: on a
// 2-core Zen 5, 110M Llama, 16 prompts, 4 adapters (benchmarks/lora.py, one round each,
// alternating), one thread 499-501 tok/s, the pool 419-451, OpenMP 541-553. One step's passes
// alone (scratch loop over the 48 LoRA linears, 16 tokens): one thread 2.6 ms, the pool 2.0-2.2,
// OpenMP 1.7-2.0. 1-token passes (<= 36K MACs here) stay inline: level either way.
constexpr int64_t kMinMacsParallel = int64_t{1} << 16;

// Software prefetch (the same arithmetic, only earlier loads). Decode passes are memory-bound:
// each adapter's A and B are read once per step, in short runs (an 8-row block of A, 8 rows of
// 3-8 KB; B's column-major rows read 16 columns at a time), too short or too many streams for
// the hardware prefetcher. Shrink: the first token's pass over a block of A prefetches the next
// work item's block, spread over its k steps. Expand: each item prefetches the rows of B of
// the item kExpandPrefetchBlocks ahead (16 columns further on, or the next group's first ones:
// 0.97x the time of prefetching within the group only). Same bits out. 110M Llama shapes, 4
// adapters x 16 tokens, 48 LoRA linears, one thread, EPYC Zen 3 at load 4, with / without
// alternated in one process: 7.3 / 9.2 ms per step (min), median ratio 0.83.
constexpr int64_t kExpandPrefetchBlocks = 8;
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 3); }

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }

#if defined(KVS_AVX2)
using namespace kvs_avx2;

// [sum(v[0]), ..., sum(v[7])] in one vector.
inline __attribute__((always_inline)) __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// out[j] = w[j] . v over n values for the 8 rows w[j] (the caller repeats a valid row where
// a block has fewer than 8).
template <typename TW, typename TV>
void dot8rows(const TW* const* w, const TV* v, int64_t n, float* out, const char* pf = nullptr,
              int64_t pf_step = 0) {
  __m256 acc[kRows];
  for (int j = 0; j < kRows; ++j) acc[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    if (pf != nullptr) {
      const char* at = pf + (k / 8) * pf_step;
      for (int64_t c = 0; c < pf_step; c += 64) prefetch_line(at + c);
    }
    const __m256 xv = load8(v + k);
    for (int j = 0; j < kRows; ++j) acc[j] = _mm256_fmadd_ps(load8(w[j] + k), xv, acc[j]);
  }
  if (k < n) {
    const __m256 xv = load8(v + k, n - k);
    for (int j = 0; j < kRows; ++j) acc[j] = _mm256_fmadd_ps(load8(w[j] + k, n - k), xv, acc[j]);
  }
  _mm256_storeu_ps(out, hsum8x8(acc));
}
#else
template <typename TW, typename TV>
void dot8rows(const TW* const* w, const TV* v, int64_t n, float* out, const char* = nullptr,
              int64_t = 0) {
  for (int j = 0; j < kRows; ++j) {
    const TW* wj = w[j];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; ++k) acc += to_f(wj[k]) * to_f(v[k]);
    out[j] = acc;
  }
}
#endif

// Column-major B (b_stack [S, N, R] with strides (N R, 1, N): LoRALinear's layout, a
// transposed view of [S, R, N] storage). The expand is then per block of 16 output columns
// an axpy over r, y[t, n0:n0+16] += sum_r s[t, r] B^T[r, n0:n0+16], for up to 4 tokens at a
// time: 2 loads of B per r shared by the tokens, no horizontal sums, y updated by vectors.
// Lane order: each output sums its r in order, one accumulator (float32).
constexpr int64_t kCols = 16;

#if defined(KVS_AVX2)
// FULL (nn == 16) is its own instantiation: with the partial loads' memcpy in the loop the
// compiler kept the accumulators on the stack, stored on every r (3x slower expands).
template <int TK, bool FULL, typename TX, typename TW>
inline void axpy_tokens_n(TX* const* yt, const float* const* st, const TW* bt, int64_t N,
                          int64_t r0, int64_t r1, int64_t nn) {
  __m256 acc[TK][2];
  for (int k = 0; k < TK; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
  constexpr bool full = FULL;
  for (int64_t r = r0; r < r1; ++r) {
    const TW* row = bt + r * N;
    const __m256 b0 = full || nn >= 8 ? load8(row) : load8(row, nn);
    const __m256 b1 =
        full ? load8(row + 8) : (nn > 8 ? load8(row + 8, nn - 8) : _mm256_setzero_ps());
    for (int k = 0; k < TK; ++k) {
      const __m256 sv = _mm256_broadcast_ss(st[k] + r);
      acc[k][0] = _mm256_fmadd_ps(b0, sv, acc[k][0]);
      acc[k][1] = _mm256_fmadd_ps(b1, sv, acc[k][1]);
    }
  }
  for (int k = 0; k < TK; ++k) {
    if (full) {
      store8(yt[k], _mm256_add_ps(load8(yt[k]), acc[k][0]));
      store8(yt[k] + 8, _mm256_add_ps(load8(yt[k] + 8), acc[k][1]));
    } else {
      const int64_t n0 = std::min<int64_t>(nn, 8), n1 = nn - n0;
      store8(yt[k], _mm256_add_ps(load8(yt[k], n0), acc[k][0]), n0);
      if (n1 > 0) store8(yt[k] + 8, _mm256_add_ps(load8(yt[k] + 8, n1), acc[k][1]), n1);
    }
  }
}

template <int TK, typename TX, typename TW>
inline void axpy_tokens(TX* const* yt, const float* const* st, const TW* bt, int64_t N,
                        int64_t r0, int64_t r1, int64_t nn) {
  if (nn == kCols)
    axpy_tokens_n<TK, true>(yt, st, bt, N, r0, r1, nn);
  else
    axpy_tokens_n<TK, false>(yt, st, bt, N, r0, r1, nn);
}
#else
template <int TK, typename TX, typename TW>
inline void axpy_tokens(TX* const* yt, const float* const* st, const TW* bt, int64_t N,
                        int64_t r0, int64_t r1, int64_t nn) {
  for (int k = 0; k < TK; ++k) {
    float acc[kCols] = {};
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < nn; ++j) acc[j] += to_f(bt[r * N + j]) * st[k][r];
    for (int64_t j = 0; j < nn; ++j) yt[k][j] = static_cast<TX>(to_f(yt[k][j]) + acc[j]);
  }
}
#endif

struct Group {
  int64_t slot, begin, end;   // tokens order[begin:end] use this slot
};

// The 8 row pointers of block `blk` of a [rows, n] matrix; a short last block repeats its
// last row (computed, then dropped).
template <typename TW>
inline void block_rows(const TW* base, int64_t blk, int64_t rows, int64_t n, const TW** w) {
  for (int j = 0; j < kRows; ++j) w[j] = base + std::min(blk * kRows + j, rows - 1) * n;
}

// Expand columns per block of 8 rows of B: a fused layer's B is block-diagonal (slice i's
// output rows use only its R / n columns, the rest is zero: LoRALinear's layout), so a block
// inside one slice reads only those columns -- the same float sums, as the skipped products
// are exact zeros (and, R / n a multiple of 8, in the same lanes: bit-identical). A block
// across a slice boundary reads every column.
struct ColRange {
  int64_t begin, size;
};

std::vector<ColRange> expand_columns(at::IntArrayRef splits, int64_t N, int64_t R,
                                     int64_t rows) {
  const int64_t n_blocks = (N + rows - 1) / rows;
  std::vector<ColRange> cols(static_cast<size_t>(n_blocks), ColRange{0, R});
  const int64_t n = static_cast<int64_t>(splits.size());
  if (n <= 1) return cols;
  const int64_t width = R / n;
  int64_t row0 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row1 = row0 + splits[i];
    for (int64_t blk = (row0 + rows - 1) / rows; blk * rows + rows <= row1; ++blk)
      cols[blk] = ColRange{i * width, width};
    if (row1 == N && row1 % rows != 0 && row1 - row1 % rows >= row0)  // a short last block
      cols[row1 / rows] = ColRange{i * width, width};
    row0 = row1;
  }
  return cols;
}

// fn(i0, i1) over [0, n) items, split over the threads when the call has enough
// multiply-adds (`macs` in all) for the second thread to pay off, else inline. Each item
// writes its own outputs, so the split does not change a bit.
template <typename F>
void for_items(int64_t n, int64_t macs, const F& fn) {
  if (macs < kMinMacsParallel || at::get_num_threads() <= 1 || n <= 1) {
    fn(0, n);
    return;
  }
  at::parallel_for(0, n, 1, fn);
}

// The expand of column-major B: items (group, block of kCols output columns).
template <typename TX, typename TW>
void expand_col_major(TX* y, int64_t y_stride, const TW* b, const float* s,
                      const std::vector<int64_t>& order, const std::vector<Group>& groups,
                      int64_t R, int64_t N, at::IntArrayRef splits, int64_t width, int64_t tokens) {
  const std::vector<ColRange> cols = expand_columns(splits, N, R, kCols);
  const int64_t n_blocks = static_cast<int64_t>(cols.size());
  for_items(static_cast<int64_t>(groups.size()) * n_blocks, tokens * N * width,
            [&](int64_t i0, int64_t i1) {
    TX* yt[4];
    const float* st[4];
    for (int64_t i = i0; i < i1; ++i) {
      const Group& g = groups[i / n_blocks];
      const int64_t blk = i % n_blocks, n0 = blk * kCols, nn = std::min(kCols, N - n0);
      const ColRange c = cols[blk];
      const TW* bt = b + g.slot * N * R + n0;     // B^T[r, n0 + j] at bt[r * N + j]
      if (i + kExpandPrefetchBlocks < i1) {   // that item's rows, in this group or the next
        const int64_t j = i + kExpandPrefetchBlocks, bj = j % n_blocks;
        const ColRange cj = cols[bj];
        const TW* bn = b + groups[j / n_blocks].slot * N * R + bj * kCols;
        for (int64_t r = cj.begin; r < cj.begin + cj.size; ++r) prefetch_line(bn + r * N);
      }
      for (int64_t p = g.begin; p < g.end; p += 4) {
        const int64_t tk = std::min<int64_t>(4, g.end - p);
        for (int64_t k = 0; k < tk; ++k) {
          yt[k] = y + order[p + k] * y_stride + n0;
          st[k] = s + (p + k) * R;
        }
        const int64_t r1 = c.begin + c.size;
        switch (tk) {
          case 4: axpy_tokens<4>(yt, st, bt, N, c.begin, r1, nn); break;
          case 3: axpy_tokens<3>(yt, st, bt, N, c.begin, r1, nn); break;
          case 2: axpy_tokens<2>(yt, st, bt, N, c.begin, r1, nn); break;
          default: axpy_tokens<1>(yt, st, bt, N, c.begin, r1, nn); break;
        }
      }
    }
  });
}

// ------------------------------------------------------------------ prefill-sized calls
// Above kTiledMinTokens tokens (prefill chunks; the fused decode op's steps, <= 16 rows, keep
// the per-block passes above) each work item is a tile of one group's tokens that runs over
// the whole of A (shrink) or of B (expand), not a block of A or B that runs over every token
// of the group: register tiles reuse each load of A / B across tokens and each load of x / s
// across rows (the per-block shrink loads 9 vectors per 8 FMAs, this one 7 per 12), and y is
// written row after row (the per-block expand's pass over 16 columns of every row of a group
// touched a new page per token: gate_up's rows are 16 KB). A and B (<= 256 KB per slot on the
// 110M Llama) stay in L2 across a group's tiles.
constexpr int64_t kTiledMinTokens = 16;
constexpr int64_t kShrinkTokens = 4, kShrinkRows = 3, kExpandTokens = 6;

struct Tile {
  int64_t slot, begin, end;   // positions [begin, end) of `order`, all of one slot
};

std::vector<Tile> group_tiles(const std::vector<Group>& groups, int64_t size) {
  std::vector<Tile> tiles;
  for (const Group& g : groups)
    for (int64_t p = g.begin; p < g.end; p += size)
      tiles.push_back({g.slot, p, std::min(g.end, p + size)});
  return tiles;
}

// s[t][j] = x[t] . w[j] over K for TT tokens and RR rows of A: TT * RR accumulators (<= 12,
// with the RR rows' vectors: 15 of the 16 registers).
#if defined(KVS_AVX2)
template <int TT, int RR, typename TX, typename TW>
inline void shrink_tile(const TX* const* xt, const TW* const* w, int64_t K, float* s,
                        int64_t s_stride) {
  __m256 acc[TT][RR];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RR; ++j) acc[t][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[RR];
    for (int j = 0; j < RR; ++j) wv[j] = load8(w[j] + k);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = load8(xt[t] + k);
      for (int j = 0; j < RR; ++j) acc[t][j] = _mm256_fmadd_ps(wv[j], xv, acc[t][j]);
    }
  }
  if (k < K) {
    __m256 wv[RR];
    for (int j = 0; j < RR; ++j) wv[j] = load8(w[j] + k, K - k);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = load8(xt[t] + k, K - k);
      for (int j = 0; j < RR; ++j) acc[t][j] = _mm256_fmadd_ps(wv[j], xv, acc[t][j]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RR; ++j) s[t * s_stride + j] = hsum8(acc[t][j]);
}
#else
template <int TT, int RR, typename TX, typename TW>
inline void shrink_tile(const TX* const* xt, const TW* const* w, int64_t K, float* s,
                        int64_t s_stride) {
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RR; ++j) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += to_f(w[j][k]) * to_f(xt[t][k]);
      s[t * s_stride + j] = acc;
    }
}
#endif

// One tile's shrink: its TT tokens against every row of the slot's A (a [R, K]).
template <int TT, typename TX, typename TW>
void shrink_tile_rows(const TX* const* xt, const TW* a, int64_t R, int64_t K, float* s) {
  for (int64_t r0 = 0; r0 < R; r0 += kShrinkRows) {
    const TW* w[kShrinkRows];
    for (int64_t j = 0; j < kShrinkRows; ++j) w[j] = a + std::min(r0 + j, R - 1) * K;
    switch (std::min(kShrinkRows, R - r0)) {
      case 3: shrink_tile<TT, 3>(xt, w, K, s + r0, R); break;
      case 2: shrink_tile<TT, 2>(xt, w, K, s + r0, R); break;
      default: shrink_tile<TT, 1>(xt, w, K, s + r0, R); break;
    }
  }
}

template <typename TX, typename TW>
void shrink_tiled(const TX* x, const TW* a, const std::vector<int64_t>& order,
                  const std::vector<Group>& groups, int64_t K, int64_t R, float* s) {
  const std::vector<Tile> tiles = group_tiles(groups, kShrinkTokens);
  const int64_t tokens = static_cast<int64_t>(order.size());
  for_items(static_cast<int64_t>(tiles.size()), tokens * R * K, [&](int64_t i0, int64_t i1) {
    const TX* xt[kShrinkTokens];
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& tl = tiles[i];
      const int64_t tt = tl.end - tl.begin;
      for (int64_t t = 0; t < tt; ++t) xt[t] = x + order[tl.begin + t] * K;
      const TW* as = a + tl.slot * R * K;
      float* st = s + tl.begin * R;
      switch (tt) {
        case 4: shrink_tile_rows<4>(xt, as, R, K, st); break;
        case 3: shrink_tile_rows<3>(xt, as, R, K, st); break;
        case 2: shrink_tile_rows<2>(xt, as, R, K, st); break;
        default: shrink_tile_rows<1>(xt, as, R, K, st); break;
      }
    }
  });
}

// The expand of column-major B per tile of up to kExpandTokens tokens: each 16-column block of
// the tile's y rows in turn (axpy_tokens: 6 tokens x 16 columns = 12 accumulators).
template <typename TX, typename TW>
void expand_tiled(TX* y, int64_t y_stride, const TW* b, const float* s,
                  const std::vector<int64_t>& order, const std::vector<Group>& groups, int64_t R,
                  int64_t N, at::IntArrayRef splits, int64_t width) {
  const std::vector<ColRange> cols = expand_columns(splits, N, R, kCols);
  const int64_t n_blocks = static_cast<int64_t>(cols.size());
  const std::vector<Tile> tiles = group_tiles(groups, kExpandTokens);
  const int64_t tokens = static_cast<int64_t>(order.size());
  for_items(static_cast<int64_t>(tiles.size()), tokens * N * width, [&](int64_t i0, int64_t i1) {
    TX* yt[kExpandTokens];
    const float* st[kExpandTokens];
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& tl = tiles[i];
      const int64_t tk = tl.end - tl.begin;
      const TW* bs = b + tl.slot * N * R;   // B^T[r, n] at bs[r * N + n]
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        const int64_t n0 = blk * kCols, nn = std::min(kCols, N - n0);
        for (int64_t k = 0; k < tk; ++k) {
          yt[k] = y + order[tl.begin + k] * y_stride + n0;
          st[k] = s + (tl.begin + k) * R;
        }
        const int64_t r0 = cols[blk].begin, r1 = r0 + cols[blk].size;
        switch (tk) {
          case 6: axpy_tokens<6>(yt, st, bs + n0, N, r0, r1, nn); break;
          case 5: axpy_tokens<5>(yt, st, bs + n0, N, r0, r1, nn); break;
          case 4: axpy_tokens<4>(yt, st, bs + n0, N, r0, r1, nn); break;
          case 3: axpy_tokens<3>(yt, st, bs + n0, N, r0, r1, nn); break;
          case 2: axpy_tokens<2>(yt, st, bs + n0, N, r0, r1, nn); break;
          default: axpy_tokens<1>(yt, st, bs + n0, N, r0, r1, nn); break;
        }
      }
    }
  });
}

// The shrink of decode-sized calls: items (group, block of 8 rows of A), each over the group's
// tokens, prefetching the next item's block.
template <typename TX, typename TW>
void shrink_blocks(const TX* x, const TW* a, const std::vector<int64_t>& order,
                   const std::vector<Group>& groups, int64_t K, int64_t R, float* s) {
  const int64_t G = static_cast<int64_t>(groups.size());
  const int64_t tokens = static_cast<int64_t>(order.size());
  const int64_t r_blocks = (R + kRows - 1) / kRows;
  for_items(G * r_blocks, tokens * R * K, [&](int64_t i0, int64_t i1) {
    const TW* w[kRows];
    float out[kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const Group& g = groups[i / r_blocks];
      const int64_t blk = i % r_blocks, r0 = blk * kRows, nr = std::min(kRows, R - r0);
      block_rows(a + g.slot * R * K, blk, R, K, w);
      const char* pf = nullptr;
      int64_t pf_step = 0;
      if (i + 1 < i1) {   // the next item's block of A (see kExpandPrefetchBlocks)
        const Group& gn = groups[(i + 1) / r_blocks];
        const int64_t bn = (i + 1) % r_blocks, rows_n = std::min(kRows, R - bn * kRows);
        pf = reinterpret_cast<const char*>(a + gn.slot * R * K + bn * kRows * K);
        const int64_t iters = std::max<int64_t>(1, K / 8);
        const int64_t bytes = rows_n * K * static_cast<int64_t>(sizeof(TW));
        pf_step = ((bytes + iters - 1) / iters + 63) / 64 * 64;   // whole lines per k step
      }
      for (int64_t p = g.begin; p < g.end; ++p) {
        dot8rows(w, x + order[p] * K, K, out, p == g.begin ? pf : nullptr, pf_step);
        std::copy(out, out + nr, s + p * R + r0);
      }
    }
  });
}

template <typename TX, typename TW>
void run(TX* y, int64_t y_stride, const TX* x, const TW* a, const TW* b, bool b_col_major,
         const std::vector<int64_t>& order, const std::vector<Group>& groups, int64_t K,
         int64_t R, int64_t N, at::IntArrayRef splits) {
  const int64_t G = static_cast<int64_t>(groups.size());
  const int64_t tokens = static_cast<int64_t>(order.size());
  std::vector<float> s(static_cast<size_t>(order.size() * R));   // by position in `order`
  const bool tiled = tokens > kTiledMinTokens;
  if (tiled)
    shrink_tiled(x, a, order, groups, K, R, s.data());
  else
    shrink_blocks(x, a, order, groups, K, R, s.data());
  const int64_t width = splits.size() > 1 ? R / static_cast<int64_t>(splits.size()) : R;
  if (b_col_major && tiled) {
    expand_tiled(y, y_stride, b, s.data(), order, groups, R, N, splits, width);
    return;
  }
  if (b_col_major) {
    expand_col_major(y, y_stride, b, s.data(), order, groups, R, N, splits, width, tokens);
    return;
  }
  const std::vector<ColRange> cols = expand_columns(splits, N, R, kRows);
  const int64_t n_blocks = static_cast<int64_t>(cols.size());
  for_items(G * n_blocks, tokens * N * width, [&](int64_t i0, int64_t i1) {
    const TW* w[kRows];
    float out[kRows];
    for (int64_t i = i0; i < i1; ++i) {
      const Group& g = groups[i / n_blocks];
      const int64_t blk = i % n_blocks, n0 = blk * kRows, nn = std::min(kRows, N - n0);
      const ColRange c = cols[blk];
      block_rows(b + g.slot * N * R + c.begin, blk, N, R, w);
      for (int64_t p = g.begin; p < g.end; ++p) {
        dot8rows(w, s.data() + p * R + c.begin, c.size, out);
        TX* yt = y + order[p] * y_stride + n0;
        for (int64_t j = 0; j < nn; ++j) yt[j] = static_cast<TX>(to_f(yt[j]) + out[j]);
      }
    }
  });
}

void lora_fused(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_stack,
                const at::Tensor& b_stack, const at::Tensor& token_slots,
                at::IntArrayRef out_splits) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a_stack.dim() == 3 && b_stack.dim() == 3 &&
                  token_slots.dim() == 1,
              "lora_fused: expected y [T, N], x [T, K], a_stack [S, R, K], b_stack [S, N, R], "
              "token_slots [T]");
  const int64_t T = x.size(0), K = x.size(1), S = a_stack.size(0), R = a_stack.size(1);
  const int64_t N = b_stack.size(1);
  TORCH_CHECK(y.size(0) == T && y.size(1) == N && token_slots.size(0) == T &&
                  a_stack.size(2) == K && b_stack.size(0) == S && b_stack.size(2) == R,
              "lora_fused: shapes do not match: y ", y.sizes(), ", x ", x.sizes(), ", a_stack ",
              a_stack.sizes(), ", b_stack ", b_stack.sizes(), ", token_slots ", token_slots.sizes());
  // B row-major (contiguous) or column-major per slot (a transposed view of [S, R, N]).
  const bool b_col_major = !b_stack.is_contiguous() && b_stack.stride(0) == N * R &&
                           b_stack.stride(1) == 1 && b_stack.stride(2) == N;
  TORCH_CHECK(x.is_contiguous() && a_stack.is_contiguous() &&
                  (b_stack.is_contiguous() || b_col_major) && y.stride(1) == 1 &&
                  token_slots.scalar_type() == at::kLong,
              "lora_fused: x, a_stack must be contiguous, b_stack contiguous or a transposed "
              "view of [S, R, N] storage, y's rows contiguous, token_slots int64");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a_stack.scalar_type() == b_stack.scalar_type(),
              "lora_fused: y must have x's dtype and b_stack a_stack's");
  int64_t split_sum = 0;
  for (const int64_t v : out_splits) {
    TORCH_CHECK(v >= 0, "lora_fused: out_splits ", out_splits, " has a negative size");
    split_sum += v;
  }
  TORCH_CHECK(out_splits.size() <= 1 ||
                  (split_sum == N && R % static_cast<int64_t>(out_splits.size()) == 0),
              "lora_fused: out_splits ", out_splits, " must sum to N = ", N, " and divide R = ", R);
  if (T == 0 || R == 0 || N == 0) return;
  // Tokens sorted by slot (stable), grouped; slot -1 dropped.
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  std::vector<int64_t> order;
  order.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < S, "lora_fused: token ", t, " has slot ", slots[t],
                ", the stacks have ", S);
    if (slots[t] >= 0) order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  std::vector<Group> groups;
  for (int64_t p = 0; p < static_cast<int64_t>(order.size()); ++p) {
    if (p == 0 || slots[order[p]] != slots[order[p - 1]]) groups.push_back({slots[order[p]], p, p});
    groups.back().end = p + 1;
  }
  if (groups.empty()) return;
  const auto xt = x.scalar_type(), wt = a_stack.scalar_type();
  const int64_t ys = y.stride(0);
  if (xt == at::kFloat && wt == at::kFloat)
    run(y.data_ptr<float>(), ys, x.data_ptr<float>(), a_stack.data_ptr<float>(),
        b_stack.data_ptr<float>(), b_col_major, order, groups, K, R, N, out_splits);
  else if (xt == at::kFloat && wt == at::kBFloat16)
    run(y.data_ptr<float>(), ys, x.data_ptr<float>(), a_stack.data_ptr<bf16>(),
        b_stack.data_ptr<bf16>(), b_col_major, order, groups, K, R, N, out_splits);
  else if (xt == at::kBFloat16 && wt == at::kBFloat16)
    run(y.data_ptr<bf16>(), ys, x.data_ptr<bf16>(), a_stack.data_ptr<bf16>(),
        b_stack.data_ptr<bf16>(), b_col_major, order, groups, K, R, N, out_splits);
  else
    TORCH_CHECK(false, "lora_fused: unsupported dtypes x ", xt, ", stacks ", wt);
}

std::string isa() {
#if defined(KVS_AVX2)
  return "avx2 (fma, 8 rows per pass; bf16 widened in registers)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("lora_fused(Tensor(a!) y, Tensor x, Tensor a_stack, Tensor b_stack, "
        "Tensor token_slots, int[] out_splits=[]) -> ()");
  m.def("lora_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("lora_fused", &lora_fused); }
