// Small-batch linear for CPU: out = x @ weight^T + bias, for the few rows of a decode step.
//
//   x       [M, K]   float32 | bfloat16, contiguous
//   weight  [N, K]   x's dtype, or bfloat16 / float16 with float32 x (16-bit weights, float32
//                    math: dtype "auto" on a CPU without bf16 instructions); contiguous
//                    (nn.Linear layout)
//           or [N/4, K/16, 4, 16] bf16 / fp16 / float32 with float32 x, [N/4, K/32, 4, 32]
//                    bfloat16 with bfloat16 x: the same weight tiled (see "Tiled bf16
//                    weights" and kF32TileCols below; ops/linear.py tile_weight makes it)
//   bias    [N]      x's dtype, optional
//   out     [M, N]   x's dtype; everything accumulates in float32
//
// With M small the op is a stream over the weight (N * K elements read once) and the x rows
// stay in L1, so the speed is the memory bandwidth. Each thread takes a contiguous run of
// output rows (at::parallel_for over groups of 4 weight rows); for each group it computes the
// M x 4 dot products with one register accumulator each, several weight rows at once so the
// FMA / dpbf16 chains are independent (one chain is latency-bound). bfloat16 uses
// _mm512_dpbf16_ps straight on the stored bf16 pairs (no widening); float32 uses FMA. K need
// not be a multiple of the vector width: the tail is a masked (zero-filled) load. Batches
// above 8 rows are done in chunks of 8 while the weight group is still in L1. Horizontal sums
// are done four accumulators at a time (hsums), and chunks of 3+ rows prefetch the weight.
//
// AVX2 (the avx2 tier, and any x / weight pair the AVX-512 code does not cover): 8 lanes; a
// 16-bit weight is widened to float32 in registers (bf16: a shift; fp16: F16C) and multiplied
// with FMA, so a bf16 or fp16 weight streams half the bytes of a float32 one at float32 math.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <c10/util/Half.h>

#include "vec_avx2.h"

namespace {

#define KVS_INLINE inline __attribute__((always_inline))

constexpr int64_t kGroupRows = 4;     // weight rows per work item
constexpr int64_t kMaxChunk = 8;      // x rows per pass over a weight group
// Minimum weight elements per thread's share: below this the fork/join costs more than the
// second core gains.
constexpr int64_t kMinElemsPerTask = 32768;
// Software prefetch along each weight row, this many bytes ahead, for chunks of at least
// kPrefetchMinRows x rows. Measured on a 49 MB weight, one thread: with 4-8 x rows the loop
// is dense enough that the hardware prefetcher falls behind (bf16 M=8: 11 -> 15 GB/s, f32 M=8:
// 12 -> 16 GB/s); with 1-2 rows it already keeps up and the extra instructions cost ~10%.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int kPrefetchMinRows = 3;
// Prefetch distance of a tiled weight's single stream (see "Tiled bf16 weights").
constexpr int64_t kTiledPrefetchBytes = 1024;
// Tiled float32 weights: the plain float32 copy kept beside a prepacked weight for small batches
// is tiled like a bf16 one ("Tiled bf16 weights"), [N/4, K/16, 4, 16]: each 16-column block one
// cache line (one AVX-512 vector, two AVX2 ones), a group's 4 rows side by side, so a one-pass
// group reads one sequential stream where plain rows read 4 interleaved ones. Same products in
// the same order as the plain layout, so the same bits. A float16 weight with float32 x (F16C
// widening, AVX2 path) is tiled the same way.
constexpr int64_t kF32TileCols = 16;

#if defined(KVS_AVX2) || defined(__AVX512F__)
// Prefetch for k-block `step` of pass `pass` over a tiled group of 4 rows (R rows per pass):
// `row0` is the group's row-0 block at that step, a step reads `step_bytes` (4 rows' blocks),
// the group is `group_bytes`. R = 4 (one pass): the group's own stream, kTiledPrefetchBytes
// ahead. R < 4: the group takes 4 / R passes and only the first reads memory (the others
// find it in L1), so a first-pass-only prefetch left memory idle 3 passes in 4 (on a Zen 4,
// avx2 tier, 5 rows ran 1.5x slower tiled than plain). Instead pass p prefetches the next
// group's blocks i with i % passes == p: the whole next group, once, spread over all passes.
//
// The hint is T1 (L2), not T0. On Zen 1-3 (and older AMD) every PREFETCHTx fills L1, so both
// are the same there; from Zen 4 on (and on Intel) T1/T2 fill L2 only, and there T0 cost
// bandwidth: on a Zen 4 (2 threads, T0 / T1 / none alternating in one process) the batch-1
// fused forward of the 110M Llama took 0.87-0.92x the time with T1 on the avx2 tier (three runs)
// and 0.86x on avx512_bf16 (no prefetch at all: 0.86-0.91x / 0.87x). T1 keeps the prefetch
// for CPUs whose hardware prefetcher needs it (Zen 1, where 1 KB ahead was measured best).
template <int R>
KVS_INLINE void prefetch_tiled(const void* row0, int64_t group_bytes, int64_t step, int pass,
                               int step_bytes) {
  const char* at = static_cast<const char*>(row0);
  if constexpr (R == 4) {
    at += kTiledPrefetchBytes;
  } else {
    if (step % (4 / R) != pass) return;
    at += group_bytes;
  }
  for (int c = 0; c < step_bytes; c += 64) _mm_prefetch(at + c, _MM_HINT_T1);
}
#endif

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// ------------------------------------------------------------------------------------------
// Portable path: plain loops (any ISA, and bf16 without AVX512_BF16).

template <typename TX, typename TW, int MB, int R>
KVS_INLINE void dots_generic(const TX* x, const TW* w, int64_t K, float (&res)[MB][R]) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      const TX* xr = x + m * K;
      const TW* wr = w + r * K;
      for (int64_t k = 0; k < K; ++k) acc += to_float(xr[k]) * to_float(wr[k]);
      res[m][r] = acc;
    }
}

// ------------------------------------------------------------------------------------------
// AVX-512 paths. Accumulator (m, r) is acc[m * R + r].

#if defined(__AVX512F__)
// Horizontal sums of C accumulators, four at a time: 128-bit lanes are folded across the four
// vectors first, so four sums cost about as many shuffles as one _mm512_reduce_add_ps. With
// K = 768 a group's dot products are only 24 vector steps long, so the reductions matter.
template <int C>
KVS_INLINE void hsums(const __m512 (&acc)[C], float* res) {
  int i = 0;
  for (; i + 4 <= C; i += 4) {
    const __m512 a = acc[i], b = acc[i + 1], c = acc[i + 2], d = acc[i + 3];
    // [a0+a2, a1+a3, b0+b2, b1+b3] (128-bit lanes), likewise for c, d
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    // [a, b, c, d] each folded to one 128-bit lane
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, u);
    res[i] = tmp[0];
    res[i + 1] = tmp[4];
    res[i + 2] = tmp[8];
    res[i + 3] = tmp[12];
  }
  for (; i < C; ++i) res[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif


#if defined(__AVX512F__)
// Tiled ("Tiled float32 weights"): w points at the row's first 16-column block, one vector.
template <int MB, int R, bool Tiled = false>
KVS_INLINE void dots_avx512(const float* x, const float* w, int64_t K, float (&res)[MB][R],
                            int pass = 0) {
  __m512 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (Tiled) {
      prefetch_tiled<R>(w - pass * R * kF32TileCols + k * 4, 4 * K * 4, k / kF32TileCols, pass,
                        4 * kF32TileCols * 4);
    } else if constexpr (MB >= kPrefetchMinRows) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m512 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm512_loadu_ps(w + (Tiled ? r * kF32TileCols + k * 4 : r * K + k));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  if (!Tiled && k < K) {     // a tiled weight has K % 16 == 0
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  hsums<MB * R>(acc, &res[0][0]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVS_HAVE_DPBF16 1
// dpbf16: lane i += a[2i] * b[2i] + a[2i+1] * b[2i+1], products exact in float32. The pairs'
// order does not matter for a dot product, so 32 stored bf16 values feed one instruction.
//
// Tiled (the plain copy of a bf16 weight kept beside its prepacked one, see "Tiled bf16
// weights" below): [N/4, K/32, 4, 32], each 32-value block one cache line, a group's 4 lines
// per step side by side. With R = 4 a group is one sequential stream (prefetch_tiled); `w`
// points at the row's first block, the pass's rows start at row `pass * R` of the group.
// Plain rows read 4 interleaved streams: 17 GB/s on the Zen 4 over the 110M Llama's linears
// at 1 x row, against 28-30 GB/s for a plain read.
constexpr int64_t kDpTileCols = 32;

template <int MB, int R, bool Tiled = false>
KVS_INLINE void dots_avx512(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K,
                            float (&res)[MB][R], int pass = 0) {
  const auto at = [K](int r, int64_t k) -> int64_t {
    return Tiled ? r * kDpTileCols + k * 4 : r * K + k;
  };
  __m512 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (Tiled) {
      prefetch_tiled<R>(w - pass * R * kDpTileCols + k * 4, 4 * K * 2, k / 32, pass,
                        4 * kDpTileCols * 2);
    } else if constexpr (MB >= kPrefetchMinRows) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + at(r, k));
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  if (!Tiled && k < K) {     // a tiled weight has K % 32 == 0
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], xv, wv[r]);
    }
  }
  hsums<MB * R>(acc, &res[0][0]);
}
#endif

// A 16-bit row of K = 768 is only 24 cache lines, so the hardware prefetcher, which trains per
// stream, kept restarting at each new group of rows: the kernel streamed 4-5 GB/s on one Zen 1
// core against 13 GB/s for a plain read. The rows of a pass are adjacent, so a software
// prefetch that walks the weight linearly, about two passes ahead, keeps memory busy
// (scratch C++ loop over 48 MB, one core, loaded machine: 10-14 GB/s; without it 4-5).
constexpr int64_t kPairPrefetchBytes = 12288;

#if defined(KVS_AVX2)
// 8 lanes; the weight (any storage) widened in registers. Accumulator (m, r) is acc[m * R + r];
// MB * R <= 8 so that accumulators, R weight vectors and one x vector fit in 16 registers.
// Tiled (float32, or float16 widened; "Tiled float32 weights"): w points at the row's first
// 16-column block; column k of row r is then in block k / 16, 4 blocks (64 values) per step.
template <typename TX, typename TW, int MB, int R, bool Tiled = false>
KVS_INLINE void dots_avx2(const TX* x, const TW* w, int64_t K, float (&res)[MB][R],
                          int pass = 0) {
  using namespace kvs_avx2;
  constexpr int64_t C = kF32TileCols;
  const auto at = [K](int r, int64_t k) -> int64_t {
    return Tiled ? r * C + (k / C) * 4 * C + k % C : r * K + k;
  };
  __m256 acc[MB * R];
  for (int i = 0; i < MB * R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (Tiled) {
      if (k % C == 0)
        prefetch_tiled<R>(w - pass * R * C + k * 4, 4 * K * sizeof(TW), k / C, pass,
                          4 * C * sizeof(TW));
    } else if constexpr (std::is_same<TW, c10::Half>::value) {
      // fp16 rows are as short as bf16 ones: the same linear prefetch (dots_avx2_bf16).
      const char* ahead = reinterpret_cast<const char*>(w) + kPairPrefetchBytes + (k / 8) * R * 16;
      for (int c = 0; c < R * 16; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    } else if constexpr (MB >= kPrefetchMinRows) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T0);
    }
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + at(r, k));
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = load8(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm256_fmadd_ps(xv, wv[r], acc[m * R + r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float t = hsum8(acc[m * R + r]);
      if constexpr (!Tiled)  // a tiled weight has K % 16 == 0
        for (int64_t j = k; j < K; ++j) t += to_float(x[m * K + j]) * to_float(w[r * K + j]);
      res[m][r] = t;
    }
}
#endif

constexpr int64_t kPairBlock = 16;

#if defined(KVS_AVX2)
// bf16 weights with float32 x, the hot pair of dtype "auto" on an AVX2-only CPU. Widening 8
// bf16 values one by one (zero-extend + shift) is two shuffle-port ops per 8 weights, and on
// Zen 1 (256-bit ops split in two) that made the stream compute-bound: a bf16 weight streamed at
// the same rows/s as a float32 one. Instead one 256-bit load takes 16 bf16 values as 8 32-bit
// pairs: the odd (high) element of each pair is already a float32 under a mask (AND), the even
// (low) one needs one shift. That is 2 ops per 16 weights. The dot product's order does not
// matter, so x is deinterleaved once per call to match (deinterleave_x16): per block of 16, its
// 8 even elements then its 8 odd ones. A tail K % 16 stays in plain order. (kPairBlock is
// defined above, outside this #if: the entry checks tiled weights against it.)

// x [M, K] -> xp [M, K]: each full 16-block as (evens, odds); the tail copied as is.
inline void deinterleave_x16(const float* x, float* xp, int64_t M, int64_t K) {
  const int64_t kv = K - K % kPairBlock;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* pr = xp + m * K;
    for (int64_t k = 0; k < kv; k += kPairBlock)
      for (int j = 0; j < 8; ++j) {
        pr[k + j] = xr[k + 2 * j];
        pr[k + 8 + j] = xr[k + 2 * j + 1];
      }
    for (int64_t k = kv; k < K; ++k) pr[k] = xr[k];
  }
}

// Like dots_avx2 for (float x deinterleaved, bf16 w). With one x row (S = 2) the even and odd
// products go to separate accumulators so that four weight rows still give eight independent
// FMA chains; with more rows there are enough chains already (S = 1).
//
// Tiled bf16 weights. Even with that prefetch, R interleaved row streams read 10-15% below a
// plain sequential read on Zen 1 (scratch C++ loop, 215 MB bf16 weight, 2 threads: 11.0-11.6
// ms against 9.7-10.1 ms for the same arithmetic on one stream, a 10.0 ms plain read). So
// dtype "auto" keeps its bf16 weights tiled: [N/4, K/16, 4, 16], the 16-element blocks of a
// group of 4 rows side by side, and a one-pass group (R = 4, 1-2 x rows) reads one contiguous
// stream, prefetched kTiledPrefetchBytes ahead (1 KB measured best there: 512 B and 2 KB were
// 5-10% slower). In the kernel, over the 110M Llama's linears (bf16, 2 threads, Zen 1): 1 x row
// 12.4 -> 10.4 ms, 2 rows 12.3 -> 11.7, 5 rows 23.3 -> 24.1 (compute-bound), 8 rows equal. `w` then points at the row's first block: row r + 1 is 16 elements on, block
// b + 1 is 64 on. The products and their order are those of the plain layout.
// (kTiledPrefetchBytes is defined above: the dpbf16 path tiles too.)

template <int MB, int R, bool Tiled>
KVS_INLINE void dots_avx2_bf16(const float* xp, const c10::BFloat16* w, int64_t K,
                               float (&res)[MB][R], int pass = 0) {
  constexpr int S = MB == 1 ? 2 : 1;
  // Element offset of (row r, column k) from w, k a multiple of kPairBlock.
  const auto at = [K](int r, int64_t k) -> int64_t {
    return Tiled ? r * kPairBlock + k * 4 : r * K + k;
  };
  __m256 acc[MB * R * S];
  for (int i = 0; i < MB * R * S; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k + kPairBlock <= K; k += kPairBlock) {
    if constexpr (Tiled) {
      prefetch_tiled<R>(w - pass * R * kPairBlock + k * 4, 4 * K * 2, k / kPairBlock, pass,
                        4 * kPairBlock * 2);
    } else {
      // The R rows are adjacent in memory: prefetch the same share of the weight
      // kPairPrefetchBytes further on, linearly (see kPairPrefetchBytes).
      const char* ahead = reinterpret_cast<const char*>(w) + kPairPrefetchBytes + (k / kPairBlock) * R * 32;
      for (int c = 0; c < R * 32; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    }
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at(r, k)));
      lo[r] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      hi[r] = _mm256_castsi256_ps(_mm256_and_si256(pair, hi_mask));
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xe = _mm256_loadu_ps(xp + m * K + k);
      const __m256 xo = _mm256_loadu_ps(xp + m * K + k + 8);
      for (int r = 0; r < R; ++r) {
        __m256& a = acc[(m * R + r) * S];
        a = _mm256_fmadd_ps(xe, lo[r], a);
        __m256& b = acc[(m * R + r) * S + S - 1];
        b = _mm256_fmadd_ps(xo, hi[r], b);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      __m256 a = acc[(m * R + r) * S];
      if constexpr (S == 2) a = _mm256_add_ps(a, acc[(m * R + r) * S + 1]);
      float t = kvs_avx2::hsum8(a);
      if constexpr (!Tiled)  // a tiled weight has K % 16 == 0
        for (int64_t j = k; j < K; ++j) t += xp[m * K + j] * to_float(w[r * K + j]);
      res[m][r] = t;
    }
}
#endif

enum class Path { kGeneric, kAvx2, kAvx512 };

// The vector path of an (x, weight) storage pair in this build: AVX-512 where the code above
// covers the pair (float/float; bf16/bf16 with dpbf16), else AVX2 where the tier has it.
template <typename TX, typename TW>
constexpr Path path_of() {
#if defined(KVS_HAVE_DPBF16)
  if (std::is_same<TX, TW>::value && !std::is_same<TX, c10::Half>::value) return Path::kAvx512;
#elif defined(__AVX512F__)
  if (std::is_same<TX, float>::value && std::is_same<TW, float>::value) return Path::kAvx512;
#endif
#if defined(KVS_AVX2)
  return Path::kAvx2;
#else
  return Path::kGeneric;
#endif
}

// float32 x with a bf16 weight on the AVX2 path: x is deinterleaved (dots_avx2_bf16).
template <typename TX, typename TW>
constexpr bool kPairedBf16 = path_of<TX, TW>() == Path::kAvx2 && std::is_same<TX, float>::value &&
                             std::is_same<TW, c10::BFloat16>::value;

// bf16 x with a bf16 weight on dpbf16.
template <typename TX, typename TW>
constexpr bool kDpBf16 = path_of<TX, TW>() == Path::kAvx512 &&
                         std::is_same<TX, c10::BFloat16>::value;

// float32 x with a float32 weight on a vector path.
template <typename TX, typename TW>
constexpr bool kVectorF32 = path_of<TX, TW>() != Path::kGeneric &&
                            std::is_same<TX, float>::value && std::is_same<TW, float>::value;

// float32 x with a float16 weight on the AVX2 path (widened by F16C).
template <typename TX, typename TW>
constexpr bool kWidenedF16 = path_of<TX, TW>() == Path::kAvx2 && std::is_same<TX, float>::value &&
                             std::is_same<TW, c10::Half>::value;

// Columns per block of a tiled weight for this pair (0: the pair has no tiled path).
template <typename TX, typename TW>
constexpr int64_t tile_cols() {
  if constexpr (kPairedBf16<TX, TW>) return kPairBlock;
  if constexpr (kVectorF32<TX, TW> || kWidenedF16<TX, TW>) return kF32TileCols;
#if defined(KVS_HAVE_DPBF16)
  if constexpr (kDpBf16<TX, TW>) return kDpTileCols;
#endif
  return 0;
}

// R weight rows [n, n + R) against x rows [0, MB): write out[m, n + r] (+ bias). Tiled: w is
// tiled (only for pairs with tile_cols() > 0, where R divides 4 and n is a multiple of R).
template <typename TX, typename TW, int MB, int R, bool Tiled>
KVS_INLINE void rows(const TX* x, const TW* w, const TX* bias, TX* out, int64_t n, int64_t N,
                     int64_t K) {
  float res[MB][R];
  constexpr Path p = path_of<TX, TW>();
  if constexpr (Tiled) {
    // A pair without a tiled path is instantiated but never called (the entry refuses it).
    if constexpr (tile_cols<TX, TW>() == 0)
      for (int m = 0; m < MB; ++m)
        for (int r = 0; r < R; ++r) res[m][r] = 0.f;
    const TW* wt = w + (n / 4) * 4 * K + (n % 4) * tile_cols<TX, TW>();
    const int pass = (n % 4) / R;
#if defined(__AVX512F__)
    if constexpr (kVectorF32<TX, TW> && p == Path::kAvx512)
      dots_avx512<MB, R, true>(x, wt, K, res, pass);
#endif
#if defined(KVS_AVX2)
    if constexpr ((kVectorF32<TX, TW> && p == Path::kAvx2) || kWidenedF16<TX, TW>)
      dots_avx2<TX, TW, MB, R, true>(x, wt, K, res, pass);
    if constexpr (kPairedBf16<TX, TW>) dots_avx2_bf16<MB, R, true>(x, wt, K, res, pass);
#endif
#if defined(KVS_HAVE_DPBF16)
    if constexpr (kDpBf16<TX, TW>) dots_avx512<MB, R, true>(x, wt, K, res, pass);
#endif
  } else if constexpr (p == Path::kAvx512) {
#if defined(__AVX512F__)
    dots_avx512<MB, R>(x, w + n * K, K, res);
#endif
  } else if constexpr (p == Path::kAvx2) {
#if defined(KVS_AVX2)
    if constexpr (kPairedBf16<TX, TW>)
      dots_avx2_bf16<MB, R, false>(x, w + n * K, K, res);  // x deinterleaved by run()
    else
      dots_avx2<TX, TW, MB, R>(x, w + n * K, K, res);
#endif
  } else {
    dots_generic<TX, TW, MB, R>(x, w + n * K, K, res);
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      const float b = bias != nullptr ? to_float(bias[n + r]) : 0.f;
      out[m * N + n + r] = static_cast<TX>(res[m][r] + b);
    }
}

// Weight rows per pass for an MB-row chunk of x. AVX-512 (32 registers): up to 6 x rows, 4
// weight rows at a time (<= 24 accumulators, so speculative decoding's 1 + 4 verification rows
// read a tiled group in one pass: bf16, Zen 4, 5-6 rows 15.5-16.8 -> 10.1-11.8 ms over the 110M
// Llama's linears); 7-8 x rows: 2 at a time. AVX2 (16 registers): at most 8 accumulators.
template <typename TX, typename TW, int MB>
constexpr int rows_per_pass() {
  if constexpr (path_of<TX, TW>() == Path::kAvx2) return MB <= 2 ? 4 : (MB <= 4 ? 2 : 1);
  return MB <= 6 ? 4 : 2;
}

// Weight rows [n0, n1) against an MB-row chunk of x.
template <typename TX, typename TW, int MB, bool Tiled>
void chunk(const TX* x, const TW* w, const TX* bias, TX* out, int64_t n0, int64_t n1, int64_t N,
           int64_t K) {
  constexpr int R = rows_per_pass<TX, TW, MB>();
  static_assert(!Tiled || 4 % R == 0, "a pass must not straddle two tiles");
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows<TX, TW, MB, R, Tiled>(x, w, bias, out, n, N, K);
  for (; n < n1; ++n) rows<TX, TW, MB, 1, Tiled>(x, w, bias, out, n, N, K);
}

// x rows per chunk against a weight group. Tiled float32 / float16 weights on the AVX2 path
// take chunks of 4: a chunk of 5-8 rows reads one weight row per pass (rows_per_pass), 4 passes
// over the group's interleaved tiles, where chunks of <= 4 read 2-4 adjacent rows per pass.
// Same chain per output, so the same bits. 49 linears of the 110M Llama, Zen 4, avx2 tier, 5-8
// rows, time against 8-row chunks: float16 0.83-0.91, float32 0.89-0.99.
//
// bf16 pairs (float32 x, bf16 weight, AVX2) take chunks of <= 4 as well: an 8-row chunk reads
// one weight row per pass (16 FMAs against 17 loads), a 2-4-row one two (10 loads), and the
// chains (S = 1) are the same. x rows are split into balanced chunks (e.g. 9 rows as 3 + 3 + 3,
// not 4 + 4 + 1) so that no chunk of a multi-row x has one row, whose bf16-pair chains (S = 2)
// would give other bits than its neighbours'. One Zen 3 thread (loaded host, two alternating
// runs), tiled bf16 weights, time of 8-row chunks over these at 8 / 12 / 16 rows: [1536, 1024]
// 1.44-1.60x, [1024, 1024] 1.54-1.91x, [32000, 1024] 1.20-1.40x, [5632, 2048] 1.16-1.98x,
// [2048, 768] 0.93-1.39x.
template <typename TX, typename TW, bool Tiled>
constexpr int64_t chunk_rows() {
  if constexpr (path_of<TX, TW>() == Path::kAvx2 &&
                ((Tiled && (kVectorF32<TX, TW> || kWidenedF16<TX, TW>)) || kPairedBf16<TX, TW>))
    return 4;
  return kMaxChunk;
}

template <typename TX, typename TW, bool Tiled = false>
__attribute__((noinline))  // vector code apart from the checking entry (see fused.cpp)
void run(const TX* x, const TW* w, const TX* bias, TX* out, int64_t M, int64_t N, int64_t K) {
  static_assert(kGroupRows == 4, "a group is one tile of a tiled weight");
  using ChunkFn = void (*)(const TX*, const TW*, const TX*, TX*, int64_t, int64_t, int64_t,
                           int64_t);
  static constexpr ChunkFn kChunks[kMaxChunk] = {
      chunk<TX, TW, 1, Tiled>, chunk<TX, TW, 2, Tiled>, chunk<TX, TW, 3, Tiled>,
      chunk<TX, TW, 4, Tiled>, chunk<TX, TW, 5, Tiled>, chunk<TX, TW, 6, Tiled>,
      chunk<TX, TW, 7, Tiled>, chunk<TX, TW, 8, Tiled>};
#if defined(KVS_AVX2)
  std::vector<float> xp;
  if constexpr (kPairedBf16<TX, TW>) {
    xp.resize(static_cast<size_t>(M * K));
    deinterleave_x16(x, xp.data(), M, K);
    x = xp.data();
  }
#endif
  const int64_t groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t grain = std::max<int64_t>(1, kMinElemsPerTask / (kGroupRows * std::max<int64_t>(K, 1)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kGroupRows, n1 = std::min(N, n0 + kGroupRows);
      // All x chunks against this group while its rows are in L1.
      constexpr int64_t cs = chunk_rows<TX, TW, Tiled>();
      const int64_t chunks = (M + cs - 1) / cs;
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int64_t mb = (M - m0) / (chunks - c);     // balanced: sizes differ by <= 1
        kChunks[mb - 1](x + m0 * K, w, bias, out + m0 * N, n0, n1, N, K);
        m0 += mb;
      }
    }
  });
}

// bf16 x with a bf16 weight, plain or tiled (the entry has checked that this build tiles it).
void run_bf16(const at::Tensor& x, const at::Tensor& weight, const void* bias, at::Tensor& out,
              int64_t M, int64_t N, int64_t K, bool tiled) {
  using B = c10::BFloat16;
  const B* xb = x.data_ptr<B>();
  const B* wb = weight.data_ptr<B>();
  const B* bb = static_cast<const B*>(bias);
  if (tiled) return run<B, B, true>(xb, wb, bb, out.data_ptr<B>(), M, N, K);
  run<B, B>(xb, wb, bb, out.data_ptr<B>(), M, N, K);
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "small_batch_linear (C++): CPU tensors only");
  const bool tiled = weight.dim() == 4;
  TORCH_CHECK(x.dim() == 2 && (weight.dim() == 2 || tiled),
              "x must be [M, K] and weight [N, K] (or tiled [N/4, K/16, 4, 16])");
  if (tiled) {
    const at::ScalarType wt = weight.scalar_type();
    const int64_t cols = x.scalar_type() == at::kBFloat16
                             ? (wt == at::kBFloat16 ? tile_cols<c10::BFloat16, c10::BFloat16>() : 0)
                         : x.scalar_type() != at::kFloat ? 0
                         : wt == at::kFloat              ? tile_cols<float, float>()
                         : wt == at::kHalf               ? tile_cols<float, c10::Half>()
                         : wt == at::kBFloat16           ? tile_cols<float, c10::BFloat16>()
                                                         : 0;
    TORCH_CHECK(cols > 0 && weight.size(2) == kGroupRows && weight.size(3) == cols,
                "small_batch_linear: a tiled weight must be [N/4, K/c, 4, c]: float32, float16 "
                "or bfloat16 with c = 16 for float32 x (a build with a vector path), bfloat16 "
                "with c = 32 for bfloat16 x (a build with dpbf16); got ", weight.scalar_type(),
                " ", weight.sizes(), " with ", x.scalar_type(), " x");
  }
  const bool same = x.scalar_type() == weight.scalar_type();
  const bool widened = x.scalar_type() == at::kFloat &&
                       (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  TORCH_CHECK((same && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)) ||
                  widened,
              "small_batch_linear: x / weight dtypes must be float32 / float32, bfloat16 / "
              "bfloat16, or float32 / bfloat16 or float16, got ", x.scalar_type(), " / ",
              weight.scalar_type());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = tiled ? weight.size(0) * kGroupRows : weight.size(0);
  const int64_t weight_k = tiled ? weight.size(1) * weight.size(3) : weight.size(1);
  TORCH_CHECK(weight_k == K, "in_features mismatch: x has ", K, ", weight has ", weight_k);
  const void* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type() && bias->device().is_cpu(),
                "bias must be a contiguous [N] CPU tensor of x's dtype");
    bias_ptr = bias->data_ptr();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias_ptr != nullptr ? out.copy_(bias->unsqueeze(0).expand({M, N}))
                                         : out.zero_();
  const float* xf = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  const float* bf = static_cast<const float*>(bias_ptr);
  switch (weight.scalar_type()) {
    case at::kFloat:
      if (tiled)
        run<float, float, true>(xf, weight.data_ptr<float>(), bf, out.data_ptr<float>(), M, N, K);
      else
        run<float, float>(xf, weight.data_ptr<float>(), bf, out.data_ptr<float>(), M, N, K);
      break;
    case at::kHalf:
      if (tiled)
        run<float, c10::Half, true>(xf, weight.data_ptr<c10::Half>(), bf, out.data_ptr<float>(),
                                    M, N, K);
      else
        run<float, c10::Half>(xf, weight.data_ptr<c10::Half>(), bf, out.data_ptr<float>(), M, N,
                              K);
      break;
    case at::kBFloat16:
      if (tiled && xf != nullptr)
        run<float, c10::BFloat16, true>(xf, weight.data_ptr<c10::BFloat16>(), bf,
                                        out.data_ptr<float>(), M, N, K);
      else if (xf != nullptr)
        run<float, c10::BFloat16>(xf, weight.data_ptr<c10::BFloat16>(), bf, out.data_ptr<float>(),
                                  M, N, K);
      else
        run_bf16(x, weight, bias_ptr, out, M, N, K, tiled);
      break;
    default: TORCH_CHECK(false, "small_batch_linear: unsupported dtype ", weight.scalar_type());
  }
  return out;
}

// Which vector path this build took, per dtype (logged by the Python side).
std::string isa() {
#if defined(KVS_HAVE_DPBF16)
  return "avx512 (f32 fma, bf16 dpbf16, 16-bit weights with f32 x: avx2 widened)";
#elif defined(__AVX512F__)
  return "avx512 (f32 fma, bf16 and 16-bit weights: avx2 widened)";
#elif defined(KVS_AVX2)
  return "avx2 (fma; bf16/fp16 widened to f32 in registers)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve), and a namespace may have only
// one of those per process.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_batch_linear_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("small_batch_linear", &small_batch_linear); }
