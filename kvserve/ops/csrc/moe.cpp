// Fused mixture-of-experts for CPU decode steps: only the routed experts' weights are read.
//
//   fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32,
//             topk_ids [T, k] int64) -> out [T, H]
//
//   out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
//            e = topk_ids[t, j]
//
// dtypes: x float32 with float32 or bfloat16 weights (bf16 widened to float32 in registers),
// or x bfloat16 with bfloat16 weights (x widened once; on dpbf16, below, not widened and the
// intermediate activation rounded to bf16); the math in float32, the output rounded once to
// x's dtype.
//
// With few (token, expert) pairs the op is a stream over the routed experts' weights, so its
// speed is the memory bandwidth. The pairs are grouped by expert (on the host: T * k is
// small), so an expert chosen by several tokens is read once for all of them. Two passes, each
// one at::parallel_for over OUTPUT ROWS, so the threads read disjoint bytes of every expert:
//   1. act[p, i] = silu(gate_i . x) * (up_i . x) for i in [0, I): thread range of i, rows
//      gate_i (w13[e, i]) and up_i (w13[e, I + i]) against the x rows of the expert's pairs;
//   2. rows[p, h] = weight_p * (w2[e, h] . act[p]) for h in [0, H): thread range of h;
// then out[t] = the sum of token t's rows, in pair order (sum_rows).
// Each output element is written by one thread only (no atomics, a fixed summation order: the
// result does not depend on the thread count). Where that split by experts is exactly balanced,
// one at::parallel_for over EXPERTS runs both passes per expert instead (split_by_expert: one
// fork / join per call, not two; bit-identical results).
//
// Vector path: AVX2 + FMA (vec_avx2.h; 8 lanes, several weight rows per pass so the FMA
// chains are independent); bf16 weights are widened with a shift. Other tiers: plain loops.
// bf16 x with bf16 weights on a tier with AVX-512 BF16: _mm512_dpbf16_ps straight on the
// stored pairs (x not widened; the intermediate activation rounded to bf16, as torch's bf16
// GEMMs and transformers round it). At 16 decode rows of the 1B MoE (2 pairs an expert) the
// widening AVX2 path was compute-bound: 2.93 ms a layer, 32 GB/s of a 46 GB/s host (Zen 5).
// Larger batches (prefill) are better served by GEMMs: the Python side sends only small
// steps here (kvserve/ops/moe.py) -- except panel-packed bf16 experts (w13 / w2 of 4 dims,
// moe_panels.h: a GEMM microkernel on dpbf16), which take every step size.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_avx2.h"
#include "vec_avx512.h"

namespace {

#define KVS_INLINE inline __attribute__((always_inline))
// Vector code lives apart from the checking entry (errors never unwind through it; see
// fused.cpp's KVS_NOINLINE).
#define KVS_NOINLINE __attribute__((noinline))

using bf16 = c10::BFloat16;

// Minimum weight elements per parallel task: below it the fork / join costs more than the
// second core gains.
constexpr int64_t kMinElemsPerTask = 32768;
// Output rows per panel of the panel-packed layout (moe_panels.h): one zmm of float32 results.
constexpr int64_t kPanelRows = 16;
// x rows (pairs of one expert) per pass over a weight row group: an expert with more pairs runs
// its chunks of them tile by tile (kTileBytes, below), so it is streamed from memory once. 8 with
// dpbf16 (32 registers; 4 weight rows a pass up to 4 x rows, 2 beyond): 128 pairs of that MoE
// 4.08 -> 3.17 ms a layer (Zen 5).
template <typename TX>
constexpr int max_rows_per_pass() {
  return std::is_same<TX, float>::value ? 4 : 8;
}
// Software prefetch: each weight row's stream prefetches the same columns of the row the next
// pass reads in its place (`ahead` elements on: the rows of a pass are 1-2 KB, too short for
// the hardware prefetcher, which restarts at every row group). A fixed byte distance along the
// row (1 KB before) ran past the row's end for the second half of every pass -- lines the pass
// was reading anyway -- and so started every pass cold. Standalone GEMV of one expert at batch
// 1 (bf16, H = I = 1024, 1 thread, Zen 3, loaded host): 2.05-2.98 -> 1.83-2.48 ms.

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }

// res[m][r] = x[m] . w[r] over K: MB float32 x rows, R weight rows (any storage).
// `ahead`: elements from w[r] + k to the line prefetched (the next pass's row r, same column).
template <typename TW, int MB, int R>
KVS_INLINE void dots(const float* const* x, const TW* const* w, int64_t K, int64_t ahead,
                     float (&res)[MB][R]) {
#if defined(KVS_AVX2)
  using namespace kvs_avx2;
  static_assert(MB * R <= 8, "accumulators, weights and one x vector must fit 16 registers");
  __m256 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k * static_cast<int64_t>(sizeof(TW))) % 64 == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + ahead), _MM_HINT_T0);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w[r] + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x[m] + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm256_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float t = hsum8(acc[m * R + r]);
      for (int64_t j = k; j < K; ++j) t += x[m][j] * to_float(w[r][j]);
      res[m][r] = t;
    }
#else
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float t = 0.f;
      for (int64_t j = 0; j < K; ++j) t += x[m][j] * to_float(w[r][j]);
      res[m][r] = t;
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVS_MOE_DPBF16 1
// res[m][r] = x[m] . w[r] over K, bf16 x and weights: dpbf16 (products exact in float32), 16
// float32 lanes an accumulator, the K % 32 tail by masked loads.
template <int MB, int R>
KVS_INLINE void dots_dp(const bf16* const* x, const bf16* const* w, int64_t K, int64_t ahead,
                        float (&res)[MB][R]) {
  static_assert(MB * R <= 16, "accumulators, weights and one x vector must fit 32 registers");
  __m512 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + ahead), _MM_HINT_T0);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[m] + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[r] + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m * R + r]);
}
#endif

// dots for x (or the activation) of storage TX: bf16 x only with bf16 weights on dpbf16.
template <typename TX, typename TW, int MB, int R>
KVS_INLINE void dots_any(const TX* const* x, const TW* const* w, int64_t K, int64_t ahead,
                         float (&res)[MB][R]) {
  if constexpr (std::is_same<TX, float>::value) {
    dots<TW, MB, R>(x, w, K, ahead, res);
  } else {
#if defined(KVS_MOE_DPBF16)
    static_assert(std::is_same<TW, bf16>::value, "bf16 x goes with bf16 weights");
    dots_dp<MB, R>(x, w, K, ahead, res);
#endif
  }
}

// Weight rows a pass reads: more for one x row (independent streams), fewer where the
// accumulators (MB * R) would not fit the registers (16 AVX2, 32 AVX-512).
template <typename TX, int MB>
constexpr int pass_rows() {
  return std::is_same<TX, float>::value ? (MB == 1 ? 4 : 2) : (MB <= 4 ? 4 : 2);
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The (token, expert) pairs grouped by expert: pairs [start[g], start[g + 1]) use expert[g].
struct Groups {
  std::vector<int64_t> expert, start, token;
  std::vector<float> weight;
};

Groups group_pairs(const int64_t* ids, const float* weights, int64_t T, int64_t k, int64_t E) {
  std::vector<int64_t> count(E, 0);
  for (int64_t p = 0; p < T * k; ++p) ++count[ids[p]];
  Groups g;
  std::vector<int64_t> pos(E, 0);
  int64_t at = 0;
  for (int64_t e = 0; e < E; ++e) {
    pos[e] = at;
    if (count[e] > 0) {
      g.expert.push_back(e);
      g.start.push_back(at);
    }
    at += count[e];
  }
  g.start.push_back(at);
  g.token.resize(T * k);
  g.weight.resize(T * k);
  for (int64_t p = 0; p < T * k; ++p) {   // stable: a group keeps its tokens in order
    const int64_t q = pos[ids[p]]++;
    g.token[q] = p / k;
    g.weight[q] = weights[p];
  }
  return g;
}

// Pass 1 for one expert's pairs [p0, p0 + MB) and rows [i0, i1): act[p, i] (stored as TX).
template <typename TX, typename TW, int MB>
KVS_INLINE void gate_up_rows(const TX* const* x, const TW* w13e, TX* const* act, int64_t i0,
                             int64_t i1, int64_t I, int64_t H) {
  constexpr int kPairsPerPass = pass_rows<TX, MB>() / 2;
  int64_t i = i0;
  for (; i + kPairsPerPass <= i1; i += kPairsPerPass) {
    const TW* w[2 * kPairsPerPass];
    for (int j = 0; j < kPairsPerPass; ++j) {
      w[2 * j] = w13e + (i + j) * H;
      w[2 * j + 1] = w13e + (I + i + j) * H;
    }
    float res[MB][2 * kPairsPerPass];
    dots_any<TX, TW, MB, 2 * kPairsPerPass>(x, w, H, kPairsPerPass * H, res);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < kPairsPerPass; ++j)
        act[m][i + j] = static_cast<TX>(silu(res[m][2 * j]) * res[m][2 * j + 1]);
  }
  for (; i < i1; ++i) {
    const TW* w[2] = {w13e + i * H, w13e + (I + i) * H};
    float res[MB][2];
    dots_any<TX, TW, MB, 2>(x, w, H, H, res);
    for (int m = 0; m < MB; ++m) act[m][i] = static_cast<TX>(silu(res[m][0]) * res[m][1]);
  }
}

// Pass 2 for one expert's pairs and rows [h0, h1): out[token, h] += weight * (w2 row . act).
template <typename TX, typename TW, int MB>
KVS_INLINE void down_rows(const TX* const* act, const TW* w2e, float* const* out,
                          const float* wt, int64_t h0, int64_t h1, int64_t I) {
  constexpr int R = pass_rows<TX, MB>();
  int64_t h = h0;
  for (; h + R <= h1; h += R) {
    const TW* w[R];
    for (int r = 0; r < R; ++r) w[r] = w2e + (h + r) * I;
    float res[MB][R];
    dots_any<TX, TW, MB, R>(act, w, I, R * I, res);
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) out[m][h + r] += wt[m] * res[m][r];
  }
  for (; h < h1; ++h) {
    const TW* w[1] = {w2e + h * I};
    float res[MB][1];
    dots_any<TX, TW, MB, 1>(act, w, I, I, res);
    for (int m = 0; m < MB; ++m) out[m][h] += wt[m] * res[m][0];
  }
}

// Calls fn(std::integral_constant<int, MB>, pairs offset) over a group's pairs in chunks of at
// most Max (4 or 8). A row's dot products do not depend on the chunk it is in.
template <int Max, int MB = 1, typename Fn>
KVS_INLINE void call_chunk(int64_t n, int64_t p, Fn&& fn) {
  if constexpr (MB == Max) fn(std::integral_constant<int, MB>{}, p);
  else if (n == MB) fn(std::integral_constant<int, MB>{}, p);
  else call_chunk<Max, MB + 1>(n, p, fn);
}

template <int Max, typename Fn>
KVS_INLINE void for_chunks(int64_t p0, int64_t p1, Fn&& fn) {
  for (int64_t p = p0; p < p1;) {
    const int64_t n = std::min<int64_t>(Max, p1 - p);
    call_chunk<Max>(n, p, fn);
    p += n;
  }
}

// Weight bytes a tile of rows holds (L2-sized): an expert with more pairs than one pass takes
// (max_rows_per_pass) runs every chunk of its pairs over a tile before the next tile, so its
// weights come from memory once and from L2 for the other chunks. Chunk-outer, the whole
// expert (6 MB in the 1B MoE) was streamed again per chunk: 16 pairs an expert (128 decode
// rows, top-2, 16 experts) cost two passes' bytes. A tile holds whole passes (a multiple of 4
// rows), and a row's dot product does not depend on its tile or chunk: same bits.
constexpr int64_t kTileBytes = 128 * 1024;

inline int64_t tile_rows(int64_t row_bytes) {
  return std::max<int64_t>(4, kTileBytes / std::max<int64_t>(1, row_bytes) / 4 * 4);
}

// fn(MB constant, first pair, t0, t1) for each tile [t0, t1) of rows [r0, r1) (rows of
// row_bytes) and, within it, each chunk of group gi's pairs.
template <typename TX, typename Fn>
KVS_INLINE void over_tiles(const Groups& g, int64_t gi, int64_t r0, int64_t r1, int64_t row_bytes,
                           Fn&& fn) {
  const int64_t tile = tile_rows(row_bytes);
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = std::min(r1, t0 + tile);
    for_chunks<max_rows_per_pass<TX>()>(g.start[gi], g.start[gi + 1],
                                        [&](auto mb, int64_t p) { fn(mb, p, t0, t1); });
  }
}

// Pass 1 for group gi's pairs over intermediate rows [i0, i1).
template <typename TX, typename TW>
KVS_INLINE void gate_up_group(const TX* xf, const TW* w13e, const Groups& g, int64_t gi, TX* act,
                              int64_t i0, int64_t i1, int64_t H, int64_t I) {
  over_tiles<TX>(g, gi, i0, i1, 2 * H * sizeof(TW), [&](auto mb, int64_t p, int64_t t0,
                                                        int64_t t1) {
    constexpr int MB = decltype(mb)::value;
    const TX* x[MB];
    TX* a[MB];
    for (int m = 0; m < MB; ++m) x[m] = xf + g.token[p + m] * H, a[m] = act + (p + m) * I;
    gate_up_rows<TX, TW, MB>(x, w13e, a, t0, t1, I, H);
  });
}

// Pass 2 for group gi's pairs over hidden rows [h0, h1).
template <typename TX, typename TW>
KVS_INLINE void down_group(const TX* act, const TW* w2e, const Groups& g, int64_t gi,
                           float* rows, int64_t h0, int64_t h1, int64_t H, int64_t I) {
  over_tiles<TX>(g, gi, h0, h1, I * sizeof(TW), [&](auto mb, int64_t p, int64_t t0,
                                                   int64_t t1) {
    constexpr int MB = decltype(mb)::value;
    const TX* a[MB];
    float* o[MB];
    for (int m = 0; m < MB; ++m) a[m] = act + (p + m) * I, o[m] = rows + (p + m) * H;
    down_rows<TX, TW, MB>(a, w2e, o, g.weight.data() + p, t0, t1, I);
  });
}

// Split by expert (one fork / join per call instead of two) only where it is exactly balanced:
// the routed experts divide evenly over the threads and each has the same number of pairs
// (batch-1 top-2 on 2 cores: one expert each). Otherwise both passes split over output rows,
// so each thread reads half of every routed expert's weights and computes half of every pair.
// Real routings are skewed (a prefill step of the 1B MoE: 2705 / 1391 pairs for the two
// threads' halves of the experts), and even when compute is balanced two threads streaming
// different experts ran slower than both streaming halves of the same ones: the rows split
// measured 2048 rows 31.7-34.7 -> 27.7-28.8 ms a layer, 64 rows 1.81-1.86 -> 1.63-1.67, level
// at 1 row (bf16 panels, routings captured from the engine, Zen 5, 2 threads). Every output
// element is the same dot product in either split and the rows are summed in the same (group)
// order, so the two give bit-identical results.
inline bool split_by_expert(const Groups& g, int64_t threads) {
  const int64_t G = static_cast<int64_t>(g.expert.size());
  if (threads <= 1) return true;
  if (G == 0 || G % threads != 0) return false;
  const int64_t n = g.start[1] - g.start[0];
  for (int64_t gi = 1; gi < G; ++gi)
    if (g.start[gi + 1] - g.start[gi] != n) return false;
  return true;
}

// Both passes for groups [g0, g1): act rows, then rows[p] = weight_p * w2[e] @ act[p].
template <typename TX, typename TW>
KVS_INLINE void run_groups(const TX* xf, const TW* w13, const TW* w2, const Groups& g, TX* act,
                           float* rows, int64_t g0, int64_t g1, int64_t H, int64_t I) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    gate_up_group<TX, TW>(xf, w13 + g.expert[gi] * 2 * I * H, g, gi, act, 0, I, H, I);
    down_group<TX, TW>(act, w2 + g.expert[gi] * H * I, g, gi, rows, 0, H, H, I);
  }
}

template <typename TX, typename TW>
KVS_NOINLINE void run_by_expert(const TX* xf, const TW* w13, const TW* w2, const Groups& g,
                                TX* act, float* rows, int64_t H, int64_t I) {
  const int64_t G = static_cast<int64_t>(g.expert.size());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    run_groups(xf, w13, w2, g, act, rows, g0, g1, H, I);
  });
}

// out[token] = sum of its pairs' weighted rows, in pair (= group) order. Both splits end here,
// so they round alike: accumulating into out inside pass 2 would let the compiler fuse the
// weight multiply and the add (-ffp-contract), rounding differently from a stored row.
// Parallel over tokens: token t's pairs, in group order, are pairs_of[t * k .. t * k + k).
std::vector<int64_t> token_pairs(const Groups& g, int64_t T, int64_t k) {
  std::vector<int64_t> pairs_of(T * k), seen(T, 0);
  const int64_t P = g.start.back();
  for (int64_t p = 0; p < P; ++p) pairs_of[g.token[p] * k + seen[g.token[p]]++] = p;
  return pairs_of;
}

// Calls row_fn(t0, t1, pairs_of) over token ranges on torch's threads (about 32k elements a
// task: a decode step's 64 tokens run on one thread).
template <typename Fn>
void over_tokens(const Groups& g, int64_t T, int64_t k, int64_t H, Fn&& row_fn) {
  const std::vector<int64_t> pairs_of = token_pairs(g, T, k);
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask * 4 / std::max<int64_t>(1, H * k));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { row_fn(t0, t1, pairs_of); });
}

void sum_rows(const Groups& g, const float* rows, float* outf, int64_t T, int64_t k, int64_t H) {
  over_tokens(g, T, k, H, [&](int64_t t0, int64_t t1, const std::vector<int64_t>& pairs_of) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = outf + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t c = 0; c < k; ++c) {
        const float* r = rows + pairs_of[t * k + c] * H;
        for (int64_t h = 0; h < H; ++h) o[h] += r[h];
      }
    }
  });
}

#if defined(KVS_MOE_DPBF16)
#include "moe_panels.h"
#endif

template <typename TX, typename TW>
KVS_NOINLINE void run(const TX* xf, const TW* w13, const TW* w2, const Groups& g, TX* act,
                      float* rows, int64_t H, int64_t I) {
  const int64_t G = static_cast<int64_t>(g.expert.size());
  // Pass 1 over the intermediate rows: each row is 2 weight rows of H per routed expert.
  const int64_t grain1 = std::max<int64_t>(4, kMinElemsPerTask / std::max<int64_t>(1, 2 * H * G));
  at::parallel_for(0, I, grain1, [&](int64_t i0, int64_t i1) {
    for (int64_t gi = 0; gi < G; ++gi)
      gate_up_group<TX, TW>(xf, w13 + g.expert[gi] * 2 * I * H, g, gi, act, i0, i1, H, I);
  });
  // Pass 2 over the hidden rows: each is one weight row of I per routed expert.
  const int64_t grain2 = std::max<int64_t>(4, kMinElemsPerTask / std::max<int64_t>(1, I * G));
  at::parallel_for(0, H, grain2, [&](int64_t h0, int64_t h1) {
    for (int64_t gi = 0; gi < G; ++gi)
      down_group<TX, TW>(act, w2 + g.expert[gi] * H * I, g, gi, rows, h0, h1, H, I);
  });
}

// Both splits over x of storage TX (float32, or bf16 on dpbf16) and weights TW.
template <typename TX, typename TW>
void run_split(bool by_expert, const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
               const Groups& g, at::Tensor& act, float* rows, int64_t H, int64_t I) {
  const TX* xp = x.data_ptr<TX>();
  TX* a = act.data_ptr<TX>();
  const TW *w13p = w13.data_ptr<TW>(), *w2p = w2.data_ptr<TW>();
  if (by_expert) run_by_expert<TX, TW>(xp, w13p, w2p, g, a, rows, H, I);
  else run<TX, TW>(xp, w13p, w2p, g, a, rows, H, I);
}

// The (token, expert) pairs of topk_ids, checked against E experts, grouped.
Groups checked_groups(const char* op, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                      int64_t T, int64_t E) {
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  topk_ids.scalar_type() == at::kLong && topk_weights.sizes() == topk_ids.sizes() &&
                  topk_weights.scalar_type() == at::kFloat && topk_ids.is_contiguous() &&
                  topk_weights.is_contiguous(),
              op, ": topk_ids must be int64 [T, k] and topk_weights float32 [T, k]");
  const int64_t k = topk_ids.size(1);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < T * k; ++p)
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, op, ": expert id ", ids[p], " out of [0, ", E, ")");
  return group_pairs(ids, topk_weights.data_ptr<float>(), T, k, E);
}

// Panel-packed experts (moe_panels.h): w13 [E, 2I/16, H/2, 32], w2 [E, H/16, I/2, 32], bf16
// x and weights, every step size.
at::Tensor fused_moe_panels(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 4 && w2.dim() == 4,
              "fused_moe: panel-packed experts are w13 [E, 2I/16, H/2, 32] and w2 "
              "[E, H/16, I/2, 32] with x [T, H]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = 2 * w2.size(2);
  TORCH_CHECK(w13.size(1) * kPanelRows == 2 * I && 2 * w13.size(2) == H && w13.size(3) == 32 &&
                  w2.size(0) == E && w2.size(1) * kPanelRows == H && w2.size(3) == 32 &&
                  I % kPanelRows == 0,
              "fused_moe: panel shapes disagree: x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kBFloat16 &&
                  w2.scalar_type() == at::kBFloat16,
              "fused_moe: panel-packed experts take bfloat16 x and weights");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe: every input must be contiguous");
  const Groups g = checked_groups("fused_moe", topk_weights, topk_ids, T, E);
#if defined(KVS_MOE_DPBF16)
  if (T == 0 || H == 0) return at::empty({T, H}, x.options());
  at::Tensor act = at::empty({T * topk_ids.size(1), I}, x.options());
  at::Tensor rows = at::empty({T * topk_ids.size(1), H}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({T, H}, x.options());
  const bool by_expert = split_by_expert(g, at::in_parallel_region() ? 1 : at::get_num_threads());
  float* r = rows.data_ptr<float>();
  run_panels(by_expert, x.data_ptr<bf16>(), w13.data_ptr<bf16>(), w2.data_ptr<bf16>(), g,
             act.data_ptr<bf16>(), r, H, I);
  sum_rows_bf16(g, r, out.data_ptr<bf16>(), T, topk_ids.size(1), H);
  return out;
#else
  TORCH_CHECK(false, "fused_moe: panel-packed experts need the avx512_bf16 build (dpbf16)");
#endif
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu() &&
                  topk_weights.device().is_cpu() && topk_ids.device().is_cpu(),
              "fused_moe (C++): CPU tensors only");
  if (w13.dim() == 4) return fused_moe_panels(x, w13, w2, topk_weights, topk_ids);
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "fused_moe: x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "fused_moe: shapes disagree: x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  const at::ScalarType xt = x.scalar_type(), wt = w13.scalar_type();
  TORCH_CHECK(wt == w2.scalar_type() &&
                  ((xt == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16)) ||
                   (xt == at::kBFloat16 && wt == at::kBFloat16)),
              "fused_moe: x / weight dtypes must be float32 / float32, float32 / bfloat16 or "
              "bfloat16 / bfloat16, got ", xt, " / ", wt, " (w2 ", w2.scalar_type(), ")");
  TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous() &&
                  topk_weights.is_contiguous() && topk_ids.is_contiguous(),
              "fused_moe: every input must be contiguous");
  const Groups g = checked_groups("fused_moe", topk_weights, topk_ids, T, E);
  const int64_t k = topk_ids.size(1);
  if (T == 0 || H == 0) return at::empty({T, H}, x.options());
#if defined(KVS_MOE_DPBF16)
  const bool dp = xt == at::kBFloat16 && wt == at::kBFloat16;
#else
  const bool dp = false;
#endif
  const at::Tensor xf = xt == at::kFloat || dp ? x : x.to(at::kFloat);
  at::Tensor act = at::empty({T * k, I}, x.options().dtype(dp ? at::kBFloat16 : at::kFloat));
  // Each pair's weighted row (zeros: pass 2 accumulates into it), then summed per token.
  at::Tensor rows = at::zeros({T * k, H}, x.options().dtype(at::kFloat));
  at::Tensor outf = at::empty({T, H}, x.options().dtype(at::kFloat));
  const bool by_expert = split_by_expert(g, at::in_parallel_region() ? 1 : at::get_num_threads());
  float* r = rows.data_ptr<float>();
#if defined(KVS_MOE_DPBF16)
  if (dp) run_split<bf16, bf16>(by_expert, xf, w13, w2, g, act, r, H, I);
  else
#endif
  if (wt == at::kFloat) run_split<float, float>(by_expert, xf, w13, w2, g, act, r, H, I);
  else run_split<float, bf16>(by_expert, xf, w13, w2, g, act, r, H, I);
  sum_rows(g, r, outf.data_ptr<float>(), T, k, H);
  return xt == at::kFloat ? outf : outf.to(xt);
}

// ------------------------------------------------------------------ packed GGUF experts
//
//   fused_moe_packed(x [T, H] f32, w13 Tensor[] (one stack of gate | up rows, or gate and up
//                    stacks), w13_types int[], w2 stack, w2_type, inter, topk_weights [T, k]
//                    f32, topk_ids [T, k] int64) -> [T, H] f32
//
// Stacks are PackedExperts' [E, ceil(N / 8), K / block, group bytes] uint8 (ops/quant's
// layout). The pairs grouped by expert as above; per routed expert, its x rows gathered and
// the int8 kernel kvserve::quant_linear (quant_linear.cpp, called through the dispatcher: its
// library is loaded where weights are packed) run on that expert's blocks only -- gate / up,
// kvserve::silu_and_mul, down -- each call parallel over output rows on torch's OpenMP
// threads. Then each pair's row times its weight, summed over k in slot order: the same
// ops and order as layers/fused_moe/packed.py's Python loop (bit-identical for k <= 2), without
// its ~0.1 ms of op calls per layer.

using QuantSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using SiluSig = at::Tensor(const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor fused_moe_packed(const at::Tensor& x, at::TensorList w13, at::IntArrayRef w13_types,
                            const at::Tensor& w2, int64_t w2_type, int64_t inter,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  static const auto quant = find_op<QuantSig>("kvserve::quant_linear");
  static const auto silu_and_mul = find_op<SiluSig>("kvserve::silu_and_mul");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(), "fused_moe_packed: x must be a contiguous float32 [T, H]");
  TORCH_CHECK((w13.size() == 1 || w13.size() == 2) && w13_types.size() == w13.size() &&
                  w2.dim() == 4, "fused_moe_packed: w13 is 1 or 2 stacks with their types, "
              "w2 a stack [E, G, K/B, bytes]");
  const int64_t T = x.size(0), H = x.size(1), E = w2.size(0);
  for (const at::Tensor& w : w13)
    TORCH_CHECK(w.dim() == 4 && w.size(0) == E, "fused_moe_packed: stacks of ", E, " experts");
  const Groups g = checked_groups("fused_moe_packed", topk_weights, topk_ids, T, E);
  const int64_t k = topk_ids.size(1);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  // Each pair's weighted row at its pair index (token * k + slot); groups list pairs by index
  // order within an expert, so pair q of group gi is the q-th pair of that expert in order.
  std::vector<int64_t> pair_of(T * k);
  {
    std::vector<int64_t> pos(E, 0);
    std::vector<int64_t> first(E, 0);
    for (size_t gi = 0; gi < g.expert.size(); ++gi) first[g.expert[gi]] = g.start[gi];
    for (int64_t p = 0; p < T * k; ++p) pair_of[first[ids[p]] + pos[ids[p]]++] = p;
  }
  at::Tensor rows = at::empty({T * k, H}, x.options());
  float* r = rows.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (size_t gi = 0; gi < g.expert.size(); ++gi) {
    const int64_t e = g.expert[gi], p0 = g.start[gi], n = g.start[gi + 1] - p0;
    at::Tensor xe = at::empty({n, H}, x.options());
    for (int64_t m = 0; m < n; ++m)
      std::copy(xp + g.token[p0 + m] * H, xp + (g.token[p0 + m] + 1) * H,
                xe.data_ptr<float>() + m * H);
    at::Tensor gate_up =
        w13.size() == 1 ? quant.call(xe, w13[0][e], w13_types[0], 2 * inter)
                        : at::cat({quant.call(xe, w13[0][e], w13_types[0], inter),
                                   quant.call(xe, w13[1][e], w13_types[1], inter)}, 1);
    at::Tensor y = quant.call(silu_and_mul.call(gate_up), w2[e], w2_type, H);
    const float* yp = y.data_ptr<float>();
    for (int64_t m = 0; m < n; ++m) {
      const float wt = g.weight[p0 + m];
      float* dst = r + pair_of[p0 + m] * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = yp[m * H + h] * wt;
    }
  }
  at::Tensor out = at::zeros({T, H}, x.options());
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float* src = r + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) o[t * H + h] += src[h];
    }
  return out;
}

std::string isa() {
#if defined(KVS_MOE_DPBF16)
  return "avx512_bf16 (dpbf16 for bf16 x and weights; else avx2 fma, bf16 weights widened)";
#elif defined(KVS_AVX2)
  return "avx2 (fma; bf16 weights widened to f32 in registers)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve).
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) "
        "-> Tensor");
  m.def("fused_moe_isa() -> str", &isa);
  m.def("fused_moe_packed(Tensor x, Tensor[] w13, int[] w13_types, Tensor w2, int w2_type, "
        "int inter, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_packed", &fused_moe_packed);
}
