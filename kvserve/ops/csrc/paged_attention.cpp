// Paged decode attention for CPU: one query token per sequence against its paged KV cache.
//
//   q            [N, H, D]             float32 | bfloat16
//   kv_cache     [2, NB, BS, Hkv, D]   same dtype as q; K = kv_cache[0], V = kv_cache[1]
//   block_tables [N, MB] int64         padded; only the first ceil(seq_len / BS) entries are read
//   seq_lens     [N] int64
//   out          [N, H, D]
//
// Query head h reads kv head h / G (G = H / Hkv), as Hugging Face's repeat_kv does. The G query
// heads of a kv head are handled together so each K/V row is loaded once, straight from its
// block (no gather copy). One pass over a sequence's blocks with an online softmax (running max
// m, running sum l, flash-decoding style); everything accumulates in float32. Slots past seq_len
// and padded table entries are never read, so whatever they hold (stale values, NaN) cannot
// reach the result.
//
// Work split with AVX2 (the avx2 tier and the AVX-512 ones) and head_dim 32 / 64 / 128: whole
// blocks per thread, each stepped through every head of the sequence (kv head by kv head, or
// token by token); a sequence's tokens are cut into chunks whose softmax states fold in a fixed
// order (see "Row order" below). Elsewhere
// (head_dim 256 on AVX-512, other head dims, portable builds): an item is (sequence, kv
// head), ordered sequence-major, and each thread gets one
// contiguous run of items holding about the same number of tokens (see split_items); a
// thread steps the items of one sequence together, block by block (attend_heads).
//
//   items:   (s0,h0) (s0,h1) ... (s0,hK-1) (s1,h0) ... (s1,hK-1) (s2,h0) ...
//   threads:  0 ............................... 0 | 1 ....................
//
// Sequence-major because a token's K (V) rows of all kv heads are adjacent in a block: a
// thread's consecutive items read neighbouring bytes of the same blocks. Measured (AVX2 Zen 1, 2
// threads, 12 heads x 64, float32, 32 sequences x 256 tokens, 50 MB of KV from memory): 7.9 ->
// 4.9 ms per call against the kv-head-major order, which read each block's 12 head slices (256
// bytes, 3 KB apart) in 12 passes far apart in time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_avx2.h"
#include "vec_avx512.h"


namespace {

struct Params {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  int64_t num_seqs, num_kv_heads, groups, head_dim, block_size, num_blocks;
  int64_t q_stride_n, q_stride_h, out_stride_n, out_stride_h;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;  // same for K and V
  int64_t table_stride;
  float scale;
};

// Per-thread scratch for one work item (the G query heads of one kv head of one sequence):
// q pre-scaled [G, D], acc [G, D] (both in the step's storage order, see Step::pos), scores /
// probabilities of the current block [G, BS], running max and sum [G], and room for 16 rows
// converted to float32 [16, D].
struct Scratch {
  std::vector<float> q, acc, s, m, l, tile, alpha;
  // bfloat16: q as stored (unscaled, natural order) for the dpbf16 score path.
  std::vector<uint16_t> qb;
  float scale = 1.f;
  Scratch(int64_t G, int64_t D, int64_t BS)
      : q(G * D), acc(G * D), s(G * BS), m(G), l(G), tile(16 * D), alpha(G), qb(G * D) {}
};

#define KVS_NOINLINE __attribute__((noinline))  // see fused.cpp

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Every block id read here was validated by the entry point (no error is raised in here).
inline int64_t checked_block(const Params& P, int64_t n, int64_t b) {
  return P.block_tables[n * P.table_stride + b];
}

// Blocks are scattered through the cache and a kv head's rows in a block are Hkv * D apart, so
// the hardware prefetchers cannot follow: the rows about kPrefetchTokens ahead are fetched while
// the current block computes (at least one block ahead; further ahead measured the same here).
constexpr int64_t kPrefetchTokens = 32;

template <typename T>
inline void prefetch_rows(const T* p, int64_t rows, int64_t row_stride, int64_t row_elems) {
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * row_stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
  }
}

// ------------------------------------------------------------------------------------------
// Portable block step (any head_dim, any ISA): plain loops the compiler may vectorise.

template <typename T>
struct GenericStep {
  static int64_t pos(int64_t d) { return d; }

  static void run(const T* kb, const T* vb, int64_t stride, int64_t ntok, int64_t G, int64_t D,
                  int64_t BS, Scratch& sc) {
    float* const s = sc.s.data();
    float* const acc = sc.acc.data();
    for (int64_t j = 0; j < ntok; ++j) {
      const T* kr = kb + j * stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = sc.q.data() + g * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(kr[d]);
        s[g * BS + j] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      float mx = sc.m[g];
      for (int64_t j = 0; j < ntok; ++j) mx = std::max(mx, sg[j]);
      const float alpha = std::exp(sc.m[g] - mx);  // exp(-inf) = 0 on the first block
      sc.m[g] = mx;
      float sum = 0.f;
      for (int64_t j = 0; j < ntok; ++j) {
        sg[j] = std::exp(sg[j] - mx);
        sum += sg[j];
      }
      sc.l[g] = sc.l[g] * alpha + sum;
      float* ag = acc + g * D;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
    }
    for (int64_t j = 0; j < ntok; ++j) {
      const T* vr = vb + j * stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * BS + j];
        float* ag = acc + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vr[d]);
      }
    }
  }
};

// ------------------------------------------------------------------------------------------
// AVX2 block step (the avx2 tier, and head dims / dtypes the AVX-512 step does not cover):
// head_dim a multiple of 8; the portable step's loops 8 floats wide, K/V widened in registers.

#if defined(KVS_AVX2)


// Online softmax update of one query head over a block's scores sg [ntok]: new running max m,
// what was accumulated (acc [D], D a multiple of 8) rescaled, sg replaced by exp(sg - m), and
// their sum added to l.
inline void softmax_update8(float* sg, int64_t ntok, float& m, float& l, float* acc, int64_t D) {
  using namespace kvs_avx2;
  float mx = m;
  for (int64_t j = 0; j < ntok; ++j) mx = std::max(mx, sg[j]);
  const float alpha = std::exp(m - mx);  // exp(-inf) = 0 on the first block
  m = mx;
  l = l * alpha + exp_sum(sg, ntok, mx);
  if (alpha != 1.f) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_mul_ps(va, _mm256_loadu_ps(acc + d)));
  }
}

template <typename T>
struct Avx2Step {
  static int64_t pos(int64_t d) { return d; }

  static void run(const T* kb, const T* vb, int64_t stride, int64_t ntok, int64_t G, int64_t D,
                  int64_t BS, Scratch& sc) {
    using namespace kvs_avx2;
    float* const s = sc.s.data();
    float* const acc = sc.acc.data();
    for (int64_t j = 0; j < ntok; ++j) {
      const T* kr = kb + j * stride;
      for (int64_t g = 0; g < G; ++g) {
        s[g * BS + j] = dot8(sc.q.data() + g * D, kr, D);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      softmax_update8(s + g * BS, ntok, sc.m[g], sc.l[g], acc + g * D, D);
    for (int64_t j = 0; j < ntok; ++j) {
      const T* vr = vb + j * stride;
      for (int64_t g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(s[g * BS + j]);
        float* ag = acc + g * D;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(ag + d, _mm256_fmadd_ps(p, load8(vr + d), _mm256_loadu_ps(ag + d)));
      }
    }
  }
};
#endif

// Where element d of a bfloat16 row widened `lanes` floats at a time with in-lane ops is kept:
// of every 2 * lanes elements, the even ones in the first vector, the odd ones in the second.
constexpr int64_t even_odd_pos(int64_t d, int64_t lanes) {
  const int64_t e = d % (2 * lanes);
  return d - e + (e % 2 ? lanes + e / 2 : e / 2);
}

// ------------------------------------------------------------------------------------------
// AVX-512 block step: head_dim = 16 * NV, a K/V row lives in NV registers. The head split runs
// it for head_dim 256; the row order below runs its block code (heads) on each kv head for 32
// / 64 / 128. Decode attention reads each K/V element once, so the cost per element decides:
// bfloat16 rows are widened with in-lane ops only (even elements, then odd ones, of every 32:
// q and acc are kept in that order too), once for all G query heads (K into the tile, V into
// registers shared by the accumulators of up to 16 / NV heads), and 16 dot products are summed
// across lanes together. With AVX512_BF16 the scores q . k skip the widening: _mm512_dpbf16_ps
// works on the stored pairs of both (in-cache 1-thread: 30 -> 38 GB/s for 12 heads, 10%
// faster with GQA 8/2).

#if defined(__AVX512F__)

#define KVS_INLINE inline __attribute__((always_inline))

template <int NV>
KVS_INLINE void load_row(const float* p, __m512 (&r)[NV]) {
  for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(p + 16 * c);
}

template <int NV>
KVS_INLINE void load_row(const c10::BFloat16* p, __m512 (&r)[NV]) {
  static_assert(NV % 2 == 0, "bfloat16 rows are read 32 elements at a time");
  // A 32-bit lane holds elements 2i (low half) and 2i+1 (high half); bfloat16 -> float32 is
  // placing the 16 bits in the high half.
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < NV / 2; ++c) {
    const __m512i x = _mm512_loadu_si512(p + 32 * c);
    r[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    r[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
}

template <int NV>
KVS_INLINE __m512 dot_partial(const __m512 (&k)[NV], const float* q) {
  __m512 a = _mm512_mul_ps(k[0], _mm512_loadu_ps(q));
  for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(q + 16 * c), a);
  return a;
}

// Lane j of the result = sum of the 16 lanes of a[j]: a transpose-and-add tree (45 ops for 16
// sums instead of ~8 per sum).
KVS_INLINE __m512 reduce16(const __m512 (&a)[16]) {
  __m512 t[8], u[4], v[2];
  for (int j = 0; j < 8; ++j)  // 256-bit halves: a[j] | a[j+8]
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44),
                         _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lanes hold a[j], a[j+8], a[j+4], a[j+12]
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[j], t[j + 4], 0x88),
                         _mm512_shuffle_f32x4(t[j], t[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)
    v[j] = _mm512_add_ps(_mm512_shuffle_ps(u[j], u[j + 2], 0x44),
                         _mm512_shuffle_ps(u[j], u[j + 2], 0xEE));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88),
                                 _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // w[4k + e] holds the sum of a[p[e] + 4 p[k]] with p = {0, 2, 1, 3}; p is its own inverse.
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, w);
}

// exp(x) lane-wise (softmax arguments, x <= 0): vec_avx512.h's.
using kvs_avx512::exp16;

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}

// One kv head's G query heads, in whichever state holds them (Scratch for the head split, a
// slice of RowState for the row order): q pre-scaled [G, D] and acc [G, D] in the step's
// storage order, qb [G, D] (bfloat16 q as stored), scores s [G, BS], running max m and sum l
// [G], a tile of 16 float32 rows [16, D], and each head's rescale of acc for this block [G].
struct Heads {
  const float* q;
  const uint16_t* qb;
  float *acc, *s, *m, *l, *tile, *alpha;
  float scale;
};

template <typename T, int NV>
struct Avx512Step {
  static constexpr int64_t D = 16 * NV;
  static constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;

  // Where logical element d of a row is kept in q / acc.
  static int64_t pos(int64_t d) { return kBf16 ? even_odd_pos(d, 16) : d; }

  // Float32 rows [t0, t0 + nt) of a block in storage order: the cache rows themselves for
  // float32, widened copies in the scratch tile for bfloat16 (each row widened once for all G
  // heads).
  static void rows_f32(const T* b, int64_t stride, int64_t t0, int64_t nt, float* tile,
                       const float* (&rows)[16]) {
    for (int64_t j = 0; j < nt; ++j) {
      if constexpr (kBf16) {
        __m512 r[NV];
        load_row(b + (t0 + j) * stride, r);
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(tile + j * D + 16 * c, r[c]);
        rows[j] = tile + j * D;
      } else {
        rows[j] = b + (t0 + j) * stride;
      }
    }
  }

  static void run(const T* kb, const T* vb, int64_t stride, int64_t ntok, int64_t G,
                  int64_t /*D*/, int64_t BS, Scratch& sc) {
    heads(kb, vb, stride, ntok, G, BS,
          Heads{sc.q.data(), sc.qb.data(), sc.acc.data(), sc.s.data(), sc.m.data(), sc.l.data(),
                sc.tile.data(), sc.alpha.data(), sc.scale});
  }

  // One block of ntok tokens for the G heads of x.
  KVS_INLINE static void heads(const T* kb, const T* vb, int64_t stride, int64_t ntok, int64_t G,
                               int64_t BS, const Heads& x) {
    for (int64_t t0 = 0; t0 < ntok; t0 += 16) scores(kb, stride, t0, ntok, G, BS, x);
    softmax(ntok, G, BS, x);
    accumulate(vb, stride, ntok, G, BS, x);
  }

  // Scores s[g, t0 + j] = q_g . k_j (q pre-scaled), tokens [t0, t0 + 16) of ntok.
  static void scores(const T* kb, int64_t stride, int64_t t0, int64_t ntok, int64_t G,
                     int64_t BS, const Heads& x) {
    const int64_t nt = std::min<int64_t>(16, ntok - t0);
    const __mmask16 mk = tail_mask(nt);
    __m512 a[16];
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      // q and k are both bfloat16: _mm512_dpbf16_ps multiplies the stored pairs exactly and
      // accumulates in float32, with no widening of k; the scale is applied to the sums.
      const __m512 vscale = _mm512_set1_ps(x.scale);
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qg = x.qb + g * D;
        __m512i qv[NV / 2];
        for (int c = 0; c < NV / 2; ++c) qv[c] = _mm512_loadu_si512(qg + 32 * c);
        for (int64_t j = 0; j < 16; ++j) {
          __m512 acc_j = _mm512_setzero_ps();
          if (j < nt) {
            const T* kr = kb + (t0 + j) * stride;
            for (int c = 0; c < NV / 2; ++c)
              acc_j = _mm512_dpbf16_ps(acc_j, (__m512bh)_mm512_loadu_si512(kr + 32 * c),
                                       (__m512bh)qv[c]);
          }
          a[j] = acc_j;
        }
        _mm512_mask_storeu_ps(x.s + g * BS + t0, mk, _mm512_mul_ps(vscale, reduce16(a)));
      }
      return;
    }
#endif
    if (G == 1) {  // k widened in registers, used once
      for (int64_t j = 0; j < 16; ++j) {
        if (j < nt) {
          __m512 k[NV];
          load_row(kb + (t0 + j) * stride, k);
          a[j] = dot_partial(k, x.q);
        } else {
          a[j] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(x.s + t0, mk, reduce16(a));
      return;
    }
    const float* rows[16];
    rows_f32(kb, stride, t0, nt, x.tile, rows);
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[NV];
      load_row(x.q + g * D, qv);
      for (int64_t j = 0; j < 16; ++j) {
        __m512 acc_j = _mm512_setzero_ps();
        if (j < nt)
          for (int c = 0; c < NV; ++c)
            acc_j = _mm512_fmadd_ps(_mm512_loadu_ps(rows[j] + 16 * c), qv[c], acc_j);
        a[j] = acc_j;
      }
      _mm512_mask_storeu_ps(x.s + g * BS + t0, mk, reduce16(a));
    }
  }

  // Online softmax update: new running max, p = exp(s - m), and alpha, the factor that brings
  // what was accumulated to the new max (applied as accumulate loads acc).
  static void softmax(int64_t ntok, int64_t G, int64_t BS, const Heads& x) {
    for (int64_t g = 0; g < G; ++g) {
      float* sg = x.s + g * BS;
      __m512 vmax = _mm512_set1_ps(x.m[g]);
      for (int64_t j = 0; j < ntok; j += 16) {
        const __mmask16 mk = tail_mask(ntok - j);
        vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, sg + j));
      }
      const float mx = _mm512_reduce_max_ps(vmax);
      const __m512 vmx = _mm512_set1_ps(mx);
      // exp(m - mx) in a register (no libm call in the chain); ~0 on the first block (m = -inf)
      const float alpha = _mm512_cvtss_f32(exp16(_mm512_sub_ps(_mm512_set1_ps(x.m[g]), vmx)));
      x.m[g] = mx;
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < ntok; j += 16) {
        const __mmask16 mk = tail_mask(ntok - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), vmx));
        _mm512_mask_storeu_ps(sg + j, mk, e);
        vsum = _mm512_mask_add_ps(vsum, mk, vsum, e);
      }
      x.l[g] = x.l[g] * alpha + _mm512_reduce_add_ps(vsum);
      x.alpha[g] = alpha;
    }
  }

  // acc[g] += sum_j p[g, j] * v_j: the accumulators of up to kGroup heads in registers (16
  // zmm), each v row loaded and widened once for all of them; GB * NV independent FMA chains.
  static constexpr int kGroup = NV <= 16 ? 16 / NV : 1;

  template <int GB>
  static void accumulate_group(const T* vb, int64_t stride, int64_t ntok, int64_t BS,
                               const Heads& x, int64_t g0) {
    __m512 av[GB][NV];
    for (int g = 0; g < GB; ++g) {
      load_row(x.acc + (g0 + g) * D, av[g]);
      const __m512 alpha = _mm512_set1_ps(x.alpha[g0 + g]);
      for (int c = 0; c < NV; ++c) av[g][c] = _mm512_mul_ps(alpha, av[g][c]);
    }
    const float* p = x.s + g0 * BS;
    for (int64_t j = 0; j < ntok; ++j) {
      __m512 v[NV];
      load_row(vb + j * stride, v);
      for (int g = 0; g < GB; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * BS + j]);
        for (int c = 0; c < NV; ++c) av[g][c] = _mm512_fmadd_ps(pj, v[c], av[g][c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(x.acc + (g0 + g) * D + 16 * c, av[g][c]);
  }

  // The last r < kGroup heads from g0 (GB counts down to r: one instance per group size).
  template <int GB>
  static void accumulate_rest(const T* vb, int64_t stride, int64_t ntok, int64_t BS,
                              const Heads& x, int64_t g0, int64_t r) {
    if constexpr (GB > 0) {
      if (r == GB) return accumulate_group<GB>(vb, stride, ntok, BS, x, g0);
      accumulate_rest<GB - 1>(vb, stride, ntok, BS, x, g0, r);
    }
  }

  static void accumulate(const T* vb, int64_t stride, int64_t ntok, int64_t G, int64_t BS,
                         const Heads& x) {
    int64_t g0 = 0;
    for (; g0 + kGroup <= G; g0 += kGroup)
      accumulate_group<kGroup>(vb, stride, ntok, BS, x, g0);
    if (g0 < G) accumulate_rest<kGroup - 1>(vb, stride, ntok, BS, x, g0, G - g0);
  }
};

#endif  // __AVX512F__

// ------------------------------------------------------------------------------------------
// Work items: kv head kh of sequence n, with its G query heads. A thread runs the items of one
// sequence it holds together, block by block (attend_heads): at each block it steps every one
// of its kv heads before moving on. A token's K (V) rows of all kv heads are adjacent, so the
// block's reads for the thread's heads are one contiguous run per token instead of one
// 256-byte slice per token per pass. Each head's arithmetic is the same as alone (same steps,
// same order): the result is bit-identical. Measured (Zen 4, avx2 tier, 2 threads, 12 heads x
// 64, float32, batch 1, after a 200 MB read, per call): 512 tokens 248 -> 226 us, level at
// 16-128 tokens.

template <typename T, typename Step>
void begin_item(const Params& P, int64_t n, int64_t kh, Scratch& sc) {
  const int64_t G = P.groups, D = P.head_dim;
  const T* q = static_cast<const T*>(P.q) + n * P.q_stride_n + kh * G * P.q_stride_h;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      sc.q[g * D + Step::pos(d)] = to_float(q[g * P.q_stride_h + d]) * P.scale;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) sc.qb[g * D + d] = q[g * P.q_stride_h + d].x;
  }
  sc.scale = P.scale;
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
}

template <typename T, typename Step>
void end_item(const Params& P, int64_t n, int64_t kh, const Scratch& sc) {
  const int64_t G = P.groups, D = P.head_dim;
  const int64_t len = P.seq_lens[n];
  T* out = static_cast<T*>(P.out) + n * P.out_stride_n + kh * G * P.out_stride_h;
  for (int64_t g = 0; g < G; ++g) {
    // An empty sequence (never scheduled for decode) gives zeros rather than 0/0.
    const float inv = len > 0 ? 1.f / sc.l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d)
      out[g * P.out_stride_h + d] = static_cast<T>(sc.acc[g * D + Step::pos(d)] * inv);
  }
}

// Prefetch distance: kPrefetchTokens, but at most kPrefetchBytes of K + V ahead (many heads
// per thread make a block's share large) and at least the next block.
constexpr int64_t kPrefetchBytes = 64 * 1024;

// That distance in blocks, for blocks whose tokens' K (and V) rows span `span` elements.
template <typename T>
inline int64_t prefetch_blocks_ahead(int64_t block_size, int64_t span) {
  const int64_t block_bytes = 2 * block_size * span * static_cast<int64_t>(sizeof(T));
  return std::max<int64_t>(1, std::min(kPrefetchTokens / block_size,
                                       kPrefetchBytes / std::max<int64_t>(block_bytes, 1)));
}

// Row order's kv-head steps (Step::kLoadAhead) read their blocks with loads, not prefetches:
// before a group of blocks (at most kLoadBytes of K and V, at least one block) is stepped, a
// loop of plain loads reads each of its cache lines once, and the steps find them in L1 / L2.
// A loop of independent loads keeps many misses in flight; the steps' own loads, between
// their arithmetic, keep few; and prefetch instructions a block or more ahead measured no
// faster than none (Zen 5 EPYC, 2 cores, avx512_bf16 tier, bf16, 16 / 4 heads x 64, 128
// sequences of 80-200 tokens, 16 layers' caches in turn: 1.65-1.70 ms a call with prefetches
// at distances 0-8 blocks, 1.20 with the loads; a pure read of the same blocks takes 0.44 ms,
// the steps from L3 0.53). float32 there: level (1.97-2.01 -> 1.95 ms); on the avx2 tier
// 2.29-2.40 -> 1.92-1.94, and 32 / 8 x 128 1.54 -> 1.39. The token step reads in memory order
// and keeps the hardware's prefetching (loads measured +5% there: batch 1, 12 heads x 64
// float32, 512 tokens).
constexpr int64_t kLoadBytes = 32 * 1024;

template <typename T>
KVS_NOINLINE void load_rows(const T* p, int64_t rows, int64_t row_stride, int64_t row_elems) {
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T));
  const bool contiguous = row_stride == row_elems;
  const int64_t runs = contiguous ? 1 : rows, run_bytes = contiguous ? rows * bytes : bytes;
  uint64_t acc = 0;
  for (int64_t r = 0; r < runs; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * row_stride);
    for (int64_t off = 0; off < run_bytes; off += 64) {
      uint64_t word;
      std::memcpy(&word, row + off, sizeof(word));
      acc |= word;
    }
  }
  asm volatile("" : : "r"(acc));  // consumed: the loads are kept
}

// Read the K and V rows of sequence n's block b ahead of their use: `span` elements a token,
// from element `head_off` of each token's rows; prefetched, or with kLoad read by load_rows.
template <bool kLoad = false, typename T>
inline void prefetch_kv_block(const Params& P, const T* K, const T* V, int64_t n, int64_t b,
                              int64_t head_off, int64_t span) {
  const int64_t off = checked_block(P, n, b) * P.kv_stride_block + head_off;
  const int64_t rows = std::min(P.block_size, P.seq_lens[n] - b * P.block_size);
  for (const T* base : {K + off, V + off}) {
    if constexpr (kLoad) load_rows(base, rows, P.kv_stride_token, span);
    else prefetch_rows(base, rows, P.kv_stride_token, span);
  }
}

// kv heads [kh0, kh1) of sequence n, each with its own scratch scs[kh - kh0].
template <typename T, typename Step>
void attend_heads(const Params& P, int64_t n, int64_t kh0, int64_t kh1, Scratch* scs) {
  const int64_t G = P.groups, D = P.head_dim, BS = P.block_size;
  const int64_t len = P.seq_lens[n];
  for (int64_t kh = kh0; kh < kh1; ++kh) begin_item<T, Step>(P, n, kh, scs[kh - kh0]);

  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  const int64_t span = (kh1 - kh0 - 1) * P.kv_stride_head + D;   // a token's rows of the heads
  const int64_t dist = prefetch_blocks_ahead<T>(BS, span);
  const int64_t nblocks = (len + BS - 1) / BS;
  auto prefetch_block = [&](int64_t b) {
    prefetch_kv_block(P, K, V, n, b, kh0 * P.kv_stride_head, span);
  };
  for (int64_t b = 0; b < std::min(dist, nblocks); ++b) prefetch_block(b);
  for (int64_t b = 0; b < nblocks; ++b) {
    if (b + dist < nblocks) prefetch_block(b + dist);
    const int64_t ntok = std::min(BS, len - b * BS);
    const int64_t base = checked_block(P, n, b) * P.kv_stride_block;
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const int64_t off = base + kh * P.kv_stride_head;
      Step::run(K + off, V + off, P.kv_stride_token, ntok, G, D, BS, scs[kh - kh0]);
    }
  }
  for (int64_t kh = kh0; kh < kh1; ++kh) end_item<T, Step>(P, n, kh, scs[kh - kh0]);
}

// Work items are ordered sequence-major, u = n * Hkv + kh: a thread's contiguous run covers
// the kv heads of consecutive sequences. Boundaries [bounds[t], bounds[t+1]) give each thread
// about the same number of tokens (plus a fixed cost per item for its setup and its first,
// unprefetched block), however ragged seq_lens are.
// Waking a second thread costs more than a small call's work (tens of microseconds here).
// A second thread pays from a few hundred (token, query head) pairs: a decode step's KV has
// been pushed out of the caches by the weights streamed since the last step, so even one
// short sequence is memory-latency bound, and two threads keep twice the loads in flight.
// Measured (Zen 4, avx2 tier, float32, batch 1, 12 heads x 64, after a 200 MB read, per
// call): 64 tokens 74 -> 56 us, 128 tokens 113 -> 81 us, 512 tokens 377 -> 248 us against
// the former bar of 8192 pairs (one thread below ~680 tokens at batch 1).
constexpr int64_t kMinWorkPerThread = 256;

// Threads for `items` work items holding `pairs` (token, query head) pairs in all.
inline int64_t num_threads(int64_t items, int64_t pairs) {
  return std::max<int64_t>(1, std::min({static_cast<int64_t>(at::get_num_threads()), items,
                                        pairs / kMinWorkPerThread}));
}

// [0, items) cut into `threads` contiguous runs [bounds[t], bounds[t + 1]) of about equal
// cost(u) each (`total` = the sum of all costs).
template <typename Cost>
std::vector<int64_t> balanced_bounds(int64_t items, int64_t threads, int64_t total, Cost cost) {
  std::vector<int64_t> bounds(threads + 1, items);
  bounds[0] = 0;
  int64_t u = 0, done = 0;  // cost of items [0, u)
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t target = total / threads * t + total % threads * t / threads;
    while (u < items && done + cost(u) <= target) done += cost(u++);
    bounds[t] = u;
  }
  return bounds;
}

std::vector<int64_t> split_items(const Params& P, int64_t threads) {
  const int64_t N = P.num_seqs;
  constexpr int64_t kItemOverhead = 16;
  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n) total += P.seq_lens[n] + kItemOverhead;
  return balanced_bounds(P.num_kv_heads * N, threads, total * P.num_kv_heads, [&](int64_t u) {
    return P.seq_lens[u / P.num_kv_heads] + kItemOverhead;
  });
}

template <typename T, typename Step>
void run(const Params& P) {
  const int64_t N = P.num_seqs;
  int64_t work = 0;
  for (int64_t n = 0; n < N; ++n) work += P.seq_lens[n];
  const int64_t threads = num_threads(N * P.num_kv_heads, work * P.num_kv_heads * P.groups);
  const std::vector<int64_t> bounds = split_items(P, threads);
  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    int64_t heads = 1;   // the most kv heads of one sequence this thread holds
    for (int64_t t = tb; t < te; ++t)
      heads = std::max(heads, std::min(P.num_kv_heads, bounds[t + 1] - bounds[t]));
    std::vector<Scratch> scs(heads, Scratch(P.groups, P.head_dim, P.block_size));
    for (int64_t t = tb; t < te; ++t)
      for (int64_t u = bounds[t]; u < bounds[t + 1];) {
        // this thread's kv heads of sequence n: the rest of its run within that sequence
        const int64_t n = u / P.num_kv_heads;
        const int64_t end = std::min(bounds[t + 1], (n + 1) * P.num_kv_heads);
        attend_heads<T, Step>(P, n, u % P.num_kv_heads, u % P.num_kv_heads + (end - u),
                              scs.data());
        u = end;
      }
  });
}

#if defined(KVS_AVX2)
// ------------------------------------------------------------------------------------------
// Row order (every tier from avx2 up; head_dim 32 / 64 / 128). A thread takes whole blocks and
// steps every query head of the sequence through them: the whole block is read by one thread
// (read ahead by a loop of loads, see load_rows), so the head split's pattern is avoided,
// where two threads read alternate parts of each token's row and each thread a head's 16 rows
// 3 KB apart. Measured per call (Zen 4, avx2 tier, 2 threads, 12 heads x 64, batch 1, after a
// 200 MB read, two alternating runs), head split -> row order (then a token's rows of all kv
// heads in memory order): float32 72 -> 57-61 us at 128 tokens, 206-210 -> 156-169 at 512,
// 546-550 -> 416-436 at 1500; bfloat16 76 -> 55 at 128, 526 -> 388 at 1500.
//
// Within a block the kv-head steps (Avx512RowStep on the AVX-512 tiers, Avx2RowStep on avx2)
// go kv head by kv head: each K and V row is loaded and widened once for the G query heads
// that read it, and the accumulators stay in registers through the block. The token step
// (Avx2TokenStep: 8 lanes, token by token in memory order) widens each row again for each of
// the G heads and updates acc in memory per (token, head). Measured (AMD EPYC Zen 5, 2
// threads, benchmarks/paged_attention.py, best of 2 alternating runs, ms), token -> kv-head
// step, 16 / 4 heads x 64, 128 sequences x 136 tokens: avx512_bf16 tier bfloat16 1.76 -> 1.21
// (from cache, best of 30 back-to-back calls: 1.07 -> 0.51), float32 2.44 -> 1.75; avx2 tier
// bfloat16 1.53 -> 1.31, float32 2.10 -> 1.67. 32 / 8 heads x 128, bfloat16: 5.29 -> 4.22
// (avx512_bf16). The token step is kept where it measured as fast or faster: on AVX-512
// float32 with G = 1 or blocks over kPrefetchBytes (12 heads x 64: 0.9-1.0x; 32 / 8 x 128:
// 0.84-0.97x), on avx2 G = 1 (bfloat16 12 heads x 64: 0.67-0.81x) and bfloat16 head_dim 128
// (0.81-0.95x); see dispatch_head_dim.
//
// Whole blocks per thread means splitting a sequence's tokens, not its heads: the tokens are
// cut into chunks of whole blocks (chunk_blocks, from the sequence's length alone), each
// chunk's softmax state starts from nothing, and a sequence's chunk states are folded in chunk
// order (fold). So the result depends on neither the batch nor the thread count. A sequence
// whose chunks span threads has its chunk states stored and folded after the parallel region
// (the same fold, the same bits).

constexpr int64_t kMinChunkTokens = 32;  // below this a fold costs a visible share of a chunk
constexpr int64_t kMaxChunks = 16;       // enough to spread one sequence over 16 threads

inline int64_t num_blocks(const Params& P, int64_t n) {
  return (P.seq_lens[n] + P.block_size - 1) / P.block_size;
}

inline int64_t chunk_blocks(const Params& P, int64_t n) {
  return std::max({int64_t{1}, kMinChunkTokens / P.block_size,
                   (num_blocks(P, n) + kMaxChunks - 1) / kMaxChunks});
}

// Softmax state of all Hq query heads of a sequence: running max m [Hq], sum l [Hq],
// accumulator acc [Hq, D]; for a chunk also q pre-scaled [Hq, D] (q and acc in the step's
// storage order, Step::pos), q as stored for bfloat16 qb [Hq, D], the block's scores s [Hq, BS]
// and a tile of float32 rows [max(16, BS), D]. Kept per thread across calls (no allocation
// per call).
struct RowState {
  std::vector<float> q, acc, s, m, l, tile, alpha;
  std::vector<uint16_t> qb;
  void fit(int64_t Hq, int64_t D, int64_t BS) {
    q.resize(Hq * D), acc.resize(Hq * D), s.resize(Hq * BS), m.resize(Hq), l.resize(Hq);
    tile.resize(std::max<int64_t>(16, BS) * D), qb.resize(Hq * D), alpha.resize(Hq);
  }
  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
  }
};

// into = into (+) the next chunk's state (m2, l2, acc2), Hq heads. Out of line so that the fold
// in the parallel region and the one after it are the same machine code (the same bits).
// The factors come from exp8, 8 heads at a time (libm's expf, twice per head and chunk, was
// ~3% of the kernel's time in a profile at 136 tokens). D is a multiple of 8.
KVS_NOINLINE void fold(RowState& into, const float* m2, const float* l2, const float* acc2,
                       int64_t Hq, int64_t D) {
  using namespace kvs_avx2;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t h0 = 0; h0 < Hq; h0 += 8) {
    const int64_t nh = std::min<int64_t>(8, Hq - h0);
    alignas(32) float ma[8] = {}, mb[8] = {}, fa[8], fb[8];
    std::copy(into.m.data() + h0, into.m.data() + h0 + nh, ma);
    std::copy(m2 + h0, m2 + h0 + nh, mb);
    const __m256 va = _mm256_load_ps(ma), vb = _mm256_load_ps(mb);
    const __m256 mx = _mm256_max_ps(va, vb);
    _mm256_store_ps(fa, exp8(_mm256_sub_ps(va, mx)));  // exp(-inf) = 0 (exp8 clamps to 0)
    _mm256_store_ps(fb, exp8(_mm256_sub_ps(vb, mx)));
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t h = h0 + i;
      if (m2[h] == kNegInf) continue;  // an empty chunk
      const float a = fa[i], b = fb[i];
      into.m[h] = std::max(into.m[h], m2[h]);
      into.l[h] = into.l[h] * a + l2[h] * b;
      float* acc = into.acc.data() + h * D;
      const float* add = acc2 + h * D;
      const __m256 a8 = _mm256_set1_ps(a), b8 = _mm256_set1_ps(b);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(_mm256_loadu_ps(acc + d), a8,
                                                  _mm256_mul_ps(_mm256_loadu_ps(add + d), b8)));
    }
  }
}

// Lane i of the result = the sum of v[i]'s 8 lanes (one tree for 8 sums instead of one
// horizontal sum each).
inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One block, every query head, rows in memory order, 8 lanes, the rows widened per query head
// and acc updated in memory per (token, head). D = 8 * NV. Kept where it measured faster than
// the kv-head steps (see dispatch_head_dim): MHA and large blocks, where reading the block in
// memory order counts for more than reusing rows across heads.
template <typename T, int NV>
struct Avx2TokenStep {
  static constexpr bool kLoadAhead = false;  // memory order: the hardware prefetchers follow
  static int64_t pos(int64_t d) { return d; }
  static void load_q(const T* q, float scale, float* dst) {
    const __m256 vs = _mm256_set1_ps(scale);
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(kvs_avx2::load8(q + 8 * c), vs));
  }

  static void run(const Params& P, const T* kb, const T* vb, int64_t ntok, RowState& st) {
    using namespace kvs_avx2;
    constexpr int64_t D = 8 * NV;
    const int64_t Hkv = P.num_kv_heads, G = P.groups, Hq = Hkv * G, BS = P.block_size;
    const int64_t ts = P.kv_stride_token, hs = P.kv_stride_head;
    float* const s = st.s.data();
    float* const acc = st.acc.data();
    // Scores, 8 (row, query head) dot products reduced together (hsum8x8: each lane's sum
    // has the same shape wherever it sits, so a score does not depend on its neighbours).
    __m256 a[8];
    int64_t where[8];
    int cnt = 0;
    auto flush = [&]() {
      for (int i = cnt; i < 8; ++i) a[i] = _mm256_setzero_ps();
      alignas(32) float r[8];
      _mm256_store_ps(r, hsum8x8(a));
      for (int i = 0; i < cnt; ++i) s[where[i]] = r[i];
      cnt = 0;
    };
    for (int64_t j = 0; j < ntok; ++j)
      for (int64_t h = 0; h < Hkv; ++h) {
        const T* kr = kb + j * ts + h * hs;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = st.q.data() + (h * G + g) * D;
          __m256 d = _mm256_mul_ps(load8(kr), _mm256_loadu_ps(qg));
          for (int c = 1; c < NV; ++c)
            d = _mm256_fmadd_ps(load8(kr + 8 * c), _mm256_loadu_ps(qg + 8 * c), d);
          a[cnt] = d;
          where[cnt] = (h * G + g) * BS + j;
          if (++cnt == 8) flush();
        }
      }
    if (cnt) flush();
    // Online softmax update per query head.
    for (int64_t qh = 0; qh < Hq; ++qh)
      softmax_update8(s + qh * BS, ntok, st.m[qh], st.l[qh], acc + qh * D, D);
    // acc += p * v, rows in memory order.
    for (int64_t j = 0; j < ntok; ++j)
      for (int64_t h = 0; h < Hkv; ++h) {
        const T* vr = vb + j * ts + h * hs;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t qh = h * G + g;
          const __m256 p = _mm256_set1_ps(s[qh * BS + j]);
          float* ag = acc + qh * D;
          for (int c = 0; c < NV; ++c)
            _mm256_storeu_ps(ag + 8 * c,
                             _mm256_fmadd_ps(p, load8(vr + 8 * c), _mm256_loadu_ps(ag + 8 * c)));
        }
      }
  }
};

// One block, every query head, a kv head at a time: its K rows (bfloat16: widened once into
// the tile) scored against its G query heads, then its V rows added to their accumulators,
// each head's accumulator in registers for the whole block. D = 8 * NV.
template <typename T, int NV>
struct Avx2RowStep {
  static_assert(NV % 2 == 0, "bfloat16 rows are widened 16 elements at a time");
  static constexpr int64_t D = 8 * NV;
  static constexpr int CH = NV < 8 ? NV : 8;  // accumulator registers per pass over a row
  static constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  static constexpr bool kLoadAhead = true;  // strided reads within a block, see attend_rows

  // bfloat16 [16c, 16c + 16) widened with in-lane ops (a shift, an and): the even elements
  // into r[2c], the odd ones into r[2c + 1]; q, the tile and acc are kept in that order.
  KVS_AVX2_INLINE static void widen(const T* p, __m256 (&r)[NV]) {
    if constexpr (kBf16) {
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int c = 0; c < NV / 2; ++c) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c));
        r[2 * c] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        r[2 * c + 1] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
      }
    } else {
      for (int c = 0; c < NV; ++c) r[c] = _mm256_loadu_ps(p + 8 * c);
    }
  }

  // Where logical element d of a row is kept in q / acc.
  static int64_t pos(int64_t d) { return kBf16 ? even_odd_pos(d, 8) : d; }

  static void load_q(const T* q, float scale, float* dst) {
    __m256 r[NV];
    widen(q, r);
    for (int c = 0; c < NV; ++c)
      _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(r[c], _mm256_set1_ps(scale)));
  }

  // Float32 rows of one kv head of the block: the cache rows for float32, else widened once
  // into the tile (row j at tile + j * D) for all G heads.
  static const float* rows(const T* b, int64_t ts, int64_t ntok, float* tile, int64_t& stride) {
    if constexpr (!kBf16) {
      stride = ts;
      return b;
    } else {
      for (int64_t j = 0; j < ntok; ++j) {
        __m256 r[NV];
        widen(b + j * ts, r);
        for (int c = 0; c < NV; ++c) _mm256_storeu_ps(tile + j * D + 8 * c, r[c]);
      }
      stride = D;
      return tile;
    }
  }

  static void run(const Params& P, const T* kb, const T* vb, int64_t ntok, RowState& st) {
    const int64_t G = P.groups, BS = P.block_size;
    const int64_t ts = P.kv_stride_token;
    for (int64_t h = 0; h < P.num_kv_heads; ++h) {
      float* const s = st.s.data() + h * G * BS;
      float* const acc = st.acc.data() + h * G * D;
      float* const alpha = st.alpha.data() + h * G;
      int64_t rs;
      const float* k = rows(kb + h * P.kv_stride_head, ts, ntok, st.tile.data(), rs);
      for (int64_t g = 0; g < G; ++g)
        scores(k, rs, ntok, st.q.data() + (h * G + g) * D, s + g * BS);
      for (int64_t g = 0; g < G; ++g)
        softmax(s + g * BS, ntok, st.m[h * G + g], st.l[h * G + g], alpha[g]);
      const float* v = rows(vb + h * P.kv_stride_head, ts, ntok, st.tile.data(), rs);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d0 = 0; d0 < D; d0 += 8 * CH)
          accumulate(v + d0, rs, ntok, s + g * BS, alpha[g], acc + g * D + d0);
    }
  }

  // a[i] = q . k_i, 8 lanes still to be summed, for the first NT (<= 8) rows k (stride rs), or
  // nt of them when NT = 0; c outer, so the rows' FMA chains run side by side.
  template <int NT>
  KVS_AVX2_INLINE static void dots(const float* k, int64_t rs, int64_t nt, const float* q,
                                   __m256 (&a)[8]) {
    const int64_t n = NT ? NT : nt;
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int c = 0; c < NV; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + 8 * c);
      for (int i = 0; i < (NT ? NT : 8); ++i)
        if (i < n) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(k + i * rs + 8 * c), qc, a[i]);
    }
  }

  // sg[j] = q . k_j for the ntok rows k, 8 rows reduced together (hsum8x8: each lane's sum has
  // the same shape wherever it sits, so a score does not depend on its neighbours).
  static void scores(const float* k, int64_t rs, int64_t ntok, const float* q, float* sg) {
    __m256 a[8];
    int64_t j0 = 0;
    for (; j0 + 8 <= ntok; j0 += 8) {
      dots<8>(k + j0 * rs, rs, 8, q, a);
      _mm256_storeu_ps(sg + j0, hsum8x8(a));
    }
    if (j0 < ntok) {
      dots<0>(k + j0 * rs, rs, ntok - j0, q, a);
      alignas(32) float r[8];
      _mm256_store_ps(r, hsum8x8(a));
      std::copy(r, r + (ntok - j0), sg + j0);
    }
  }

  // Online softmax update of one head over the block's scores sg [ntok]: new running max m,
  // sg replaced by exp(sg - m), l updated, and alpha = exp(m_old - m), the factor that brings
  // what was accumulated to the new max (applied by accumulate).
  static void softmax(float* sg, int64_t ntok, float& m, float& l, float& alpha) {
    using namespace kvs_avx2;
    __m256 vmax = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= ntok; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + j));
    float mx = hmax8(vmax);
    for (; j < ntok; ++j) mx = std::max(mx, sg[j]);
    // exp8 in a register, no libm call in the chain; 0 on the first block (m = -inf)
    alpha = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m - mx)));
    m = mx;
    l = l * alpha + exp_sum(sg, ntok, mx);
  }

  // acc[0, 8 * CH) = alpha * acc + sum_j p[j] * v_j[0, 8 * CH), acc in registers.
  static void accumulate(const float* v, int64_t rs, int64_t ntok, const float* p, float alpha,
                         float* acc) {
    __m256 av[CH];
    const __m256 va = _mm256_set1_ps(alpha);
    for (int c = 0; c < CH; ++c) av[c] = _mm256_mul_ps(va, _mm256_loadu_ps(acc + 8 * c));
    for (int64_t j = 0; j < ntok; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int c = 0; c < CH; ++c)
        av[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * rs + 8 * c), av[c]);
    }
    for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + 8 * c, av[c]);
  }
};

#if defined(__AVX512F__)
// The AVX-512 block step (Avx512Step::heads) on each kv head of the block in turn. D = 16 * NV.
template <typename T, int NV>
struct Avx512RowStep {
  static constexpr bool kLoadAhead = true;  // strided reads within a block, see attend_rows
  static int64_t pos(int64_t d) { return Avx512Step<T, NV>::pos(d); }

  // One head's q pre-scaled, in storage order (load_row's: Step::pos).
  static void load_q(const T* q, float scale, float* dst) {
    __m512 r[NV];
    load_row(q, r);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(r[c], vs));
  }

  static void run(const Params& P, const T* kb, const T* vb, int64_t ntok, RowState& st) {
    constexpr int64_t D = 16 * NV;
    const int64_t G = P.groups, BS = P.block_size;
    for (int64_t h = 0; h < P.num_kv_heads; ++h) {
      const Heads x{st.q.data() + h * G * D, st.qb.data() + h * G * D, st.acc.data() + h * G * D,
                    st.s.data() + h * G * BS, st.m.data() + h * G,    st.l.data() + h * G,
                    st.tile.data(),           st.alpha.data() + h * G, P.scale};
      const int64_t off = h * P.kv_stride_head;
      Avx512Step<T, NV>::heads(kb + off, vb + off, P.kv_stride_token, ntok, G, BS, x);
    }
  }
};
#endif

// Chunk states of the sequences that span threads: per chunk m [Hq], l [Hq], acc [Hq * D].
struct StoredChunks {
  std::vector<float> data;
  std::vector<int64_t> base;  // per sequence: offset of its chunk 0, or -1 (not stored)
  int64_t per_chunk = 0;
  float* at(int64_t n, int64_t c) { return data.data() + base[n] + c * per_chunk; }
};

// Step::pos for d < D (D <= kMaxRowDim), looked up rather than recomputed per element.
constexpr int64_t kMaxRowDim = 128;
template <typename Step>
void pos_table(int64_t D, int32_t (&pos)[kMaxRowDim]) {
  for (int64_t d = 0; d < D; ++d) pos[d] = static_cast<int32_t>(Step::pos(d));
}

template <typename T, typename Step>
void write_rows(const Params& P, int64_t n, const RowState& st) {
  using namespace kvs_avx2;
  const int64_t Hq = P.num_kv_heads * P.groups, D = P.head_dim;
  int32_t pos[kMaxRowDim];
  pos_table<Step>(D, pos);
  T* out = static_cast<T*>(P.out) + n * P.out_stride_n;
  for (int64_t qh = 0; qh < Hq; ++qh) {
    // An empty sequence (never scheduled for decode) gives zeros rather than 0/0.
    const float inv = P.seq_lens[n] > 0 ? 1.f / st.l[qh] : 0.f;
    const float* acc = st.acc.data() + qh * D;
    alignas(32) float row[kMaxRowDim];
    for (int64_t d = 0; d < D; ++d) row[d] = acc[pos[d]];
    // narrowed 8 at a time (store8 rounds as static_cast<T> does)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 8)
      store8(out + qh * P.out_stride_h + d, _mm256_mul_ps(_mm256_load_ps(row + d), vinv));
  }
}

// Chunks [c0, c1) of sequence n: each chunk stepped block by block into `part`, then folded
// into `total` (the thread holds the whole sequence: written out at the end) or stored.
template <typename T, typename Step>
void attend_rows(const Params& P, int64_t n, int64_t c0, int64_t c1, RowState& part,
                 RowState& total, StoredChunks& stored) {
  const int64_t Hq = P.num_kv_heads * P.groups, D = P.head_dim, BS = P.block_size;
  const int64_t len = P.seq_lens[n], cb = chunk_blocks(P, n);
  const bool store = stored.base[n] >= 0;
  const T* q = static_cast<const T*>(P.q) + n * P.q_stride_n;
  for (int64_t qh = 0; qh < Hq; ++qh)
    Step::load_q(q + qh * P.q_stride_h, P.scale, part.q.data() + qh * D);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t qh = 0; qh < Hq; ++qh)
      for (int64_t d = 0; d < D; ++d) part.qb[qh * D + d] = q[qh * P.q_stride_h + d].x;
  }
  if (!store) total.reset();
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  const int64_t b_end = std::min(c1 * cb, num_blocks(P, n));
  const int64_t span = (P.num_kv_heads - 1) * P.kv_stride_head + D;  // a token's rows
  const int64_t block_bytes = 2 * BS * span * static_cast<int64_t>(sizeof(T));
  const int64_t group = std::max<int64_t>(1, kLoadBytes / block_bytes);
  for (int64_t c = c0; c < c1; ++c) {
    part.reset();
    const int64_t c_end = std::min((c + 1) * cb, b_end);
    for (int64_t b = c * cb; b < c_end; ++b) {
      if (Step::kLoadAhead && (b - c * cb) % group == 0)
        for (int64_t bl = b; bl < std::min(b + group, c_end); ++bl)
          prefetch_kv_block<true>(P, K, V, n, bl, 0, span);
      const int64_t off = checked_block(P, n, b) * P.kv_stride_block;
      Step::run(P, K + off, V + off, std::min(BS, len - b * BS), part);
    }
    if (!store) {
      fold(total, part.m.data(), part.l.data(), part.acc.data(), Hq, D);
      continue;
    }
    float* dst = stored.at(n, c);
    std::copy(part.m.begin(), part.m.end(), dst);
    std::copy(part.l.begin(), part.l.end(), dst + Hq);
    std::copy(part.acc.begin(), part.acc.end(), dst + 2 * Hq);
  }
  if (!store) write_rows<T, Step>(P, n, total);
}

template <typename T, typename Step>
void run_rows(const Params& P) {
  const int64_t N = P.num_seqs, BS = P.block_size;
  const int64_t Hq = P.num_kv_heads * P.groups, D = P.head_dim;
  // The chunk list, sequence-major, and each thread's contiguous run of it with about the
  // same tokens (plus a fixed cost per chunk: its setup, fold and first block).
  constexpr int64_t kChunkOverhead = 16;
  std::vector<int64_t> first(N + 1, 0), seq, cost;
  int64_t total_cost = 0, work = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t cb = chunk_blocks(P, n), len = P.seq_lens[n];
    const int64_t chunks = std::max<int64_t>(1, (num_blocks(P, n) + cb - 1) / cb);
    for (int64_t c = 0; c < chunks; ++c) {
      cost.push_back(std::max<int64_t>(0, std::min(cb * BS, len - c * cb * BS)) + kChunkOverhead);
      seq.push_back(n);
      total_cost += cost.back();
    }
    first[n + 1] = first[n] + chunks;
    work += len;
  }
  const int64_t items = first[N];
  const int64_t threads = num_threads(items, work * Hq);
  const std::vector<int64_t> bounds =
      balanced_bounds(items, threads, total_cost, [&](int64_t u) { return cost[u]; });
  StoredChunks stored{{}, std::vector<int64_t>(N, -1), Hq * (D + 2)};
  int64_t size = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t u = bounds[t];
    if (u <= 0 || u >= items || u == first[seq[u]] || stored.base[seq[u]] >= 0) continue;
    stored.base[seq[u]] = size;                       // a cut inside sequence seq[u]
    size += (first[seq[u] + 1] - first[seq[u]]) * stored.per_chunk;
  }
  stored.data.resize(size);

  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    static thread_local RowState part, total;
    part.fit(Hq, D, BS);
    total.fit(Hq, D, BS);
    for (int64_t t = tb; t < te; ++t)
      for (int64_t u = bounds[t]; u < bounds[t + 1];) {
        const int64_t n = seq[u], end = std::min(bounds[t + 1], first[n + 1]);
        attend_rows<T, Step>(P, n, u - first[n], end - first[n], part, total, stored);
        u = end;
      }
  });
  if (size == 0) return;                  // no sequence spans threads
  RowState st;
  st.fit(Hq, D, BS);
  for (int64_t n = 0; n < N; ++n) {
    if (stored.base[n] < 0) continue;
    st.reset();
    for (int64_t c = 0; c < first[n + 1] - first[n]; ++c) {
      const float* x = stored.at(n, c);
      fold(st, x, x + Hq, x + 2 * Hq, Hq, D);
    }
    write_rows<T, Step>(P, n, st);
  }
}
#endif  // KVS_AVX2

#if defined(KVS_AVX2)
// The row order with Step<T, head_dim / lanes> for head_dim 32 / 64 / 128; false for others.
template <typename T, template <typename, int> class Step, int kLanes>
bool run_rows_for(const Params& P) {
  switch (P.head_dim) {
    case 32: run_rows<T, Step<T, 32 / kLanes>>(P); return true;
    case 64: run_rows<T, Step<T, 64 / kLanes>>(P); return true;
    case 128: run_rows<T, Step<T, 128 / kLanes>>(P); return true;
    default: return false;
  }
}
#endif

template <typename T>
KVS_NOINLINE void dispatch_head_dim(const Params& P) {
#if defined(KVS_AVX2)
  // Row order on every tier with AVX2 (AVX-512 builds too): a decode step's KV is cold, and
  // there reading whole blocks per thread (then in memory order, with the 8-lane step) beat
  // the AVX-512 step's head split (Zen 4, avx512_bf16 tier, 12 heads x 64, batch 1, after a
  // 200 MB read, two alternating runs: float32 86 -> 65 us at 128 tokens, 224 -> 174 at 512,
  // 666 -> 469 at 1500; bfloat16 60 -> 52, 152 -> 134, 443 -> 361). The row order now steps
  // each block with the AVX-512 block code on those tiers (see "Row order").
  // The kv-head steps (rows reused across a group) where they measured faster than the token
  // step (see "Row order").
  const bool f32 = std::is_same_v<T, float>;
#if defined(__AVX512F__)
  const int64_t block_bytes = 2 * P.block_size * P.num_kv_heads * P.head_dim * sizeof(T);
  const bool by_kv_head = !f32 || (P.groups >= 2 && block_bytes <= kPrefetchBytes);
  if (by_kv_head && run_rows_for<T, Avx512RowStep, 16>(P)) return;
#else
  const bool by_kv_head = P.groups >= 2 && (f32 || P.head_dim <= 64);
  if (by_kv_head && run_rows_for<T, Avx2RowStep, 8>(P)) return;
#endif
  if (run_rows_for<T, Avx2TokenStep, 8>(P)) return;
#endif
#if defined(__AVX512F__)
  switch (P.head_dim) {
    case 256: return run<T, Avx512Step<T, 16>>(P);
    default: break;
  }
#endif
#if defined(KVS_AVX2)
  if (P.head_dim % 8 == 0) return run<T, Avx2Step<T>>(P);
#endif
  run<T, GenericStep<T>>(P);
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                                  double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && kv_cache.device().is_cpu(),
              "paged_decode_attention (C++): CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache's last dimension must be contiguous");
  const int64_t N = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "head_dim mismatch between q and kv_cache");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == N,
              "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) == N, "seq_lens must be [num_seqs]");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t MB = block_tables.size(1);
  {
    const int64_t* sl = seq_lens.data_ptr<int64_t>();
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    // Validate everything the kernel will read: nothing is checked inside the parallel region.
    for (int64_t i = 0; i < N; ++i) {
      TORCH_CHECK(sl[i] >= 0 && sl[i] <= MB * BS, "seq_lens[", i, "] = ", sl[i],
                  " does not fit in ", MB, " blocks of ", BS);
      for (int64_t b = 0; b < (sl[i] + BS - 1) / BS; ++b)
        TORCH_CHECK(bt[i * MB + b] >= 0 && bt[i * MB + b] < NB, "paged_decode_attention: block id ",
                    bt[i * MB + b], " out of range [0, ", NB, ") for sequence ", i);
    }
  }
  at::Tensor out = at::empty({N, H, D}, q.options());
  if (N == 0) return out;

  Params P;
  P.q = q.data_ptr();
  P.out = out.data_ptr();
  P.k = kv_cache.select(0, 0).data_ptr();
  P.v = kv_cache.select(0, 1).data_ptr();
  P.block_tables = block_tables.data_ptr<int64_t>();
  P.seq_lens = seq_lens.data_ptr<int64_t>();
  P.num_seqs = N;
  P.num_kv_heads = Hkv;
  P.groups = H / Hkv;
  P.head_dim = D;
  P.block_size = BS;
  P.num_blocks = NB;
  P.q_stride_n = q.stride(0);
  P.q_stride_h = q.stride(1);
  P.out_stride_n = out.stride(0);
  P.out_stride_h = out.stride(1);
  P.kv_stride_block = kv_cache.stride(1);
  P.kv_stride_token = kv_cache.stride(2);
  P.kv_stride_head = kv_cache.stride(3);
  P.table_stride = block_tables.stride(0);
  P.scale = static_cast<float>(scale);

  switch (q.scalar_type()) {
    case at::kFloat: dispatch_head_dim<float>(P); break;
    case at::kBFloat16: dispatch_head_dim<c10::BFloat16>(P); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Which vector path this build took (logged by the Python side, checked by the tests).
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(KVS_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("paged_attention_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
