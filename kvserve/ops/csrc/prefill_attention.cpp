// Paged prefill attention for CPU: every prefill chunk of a step in one call, K/V read in place.
//
//   q             [T, H, D]             float32 | bfloat16, last dim contiguous
//   kv_cache      [2, NB, BS, Hkv, D]   same dtype; K = kv_cache[0], V = kv_cache[1]
//   query_starts  [P] int64             chunk p's queries are rows starts[p] .. + lens[p] of q
//   query_lens    [P] int64
//   context_lens  [P] int64             tokens of chunk p already cached before this step
//   block_tables  [P, MB] int64         chunk p's key j: block block_tables[p, j / BS], slot j % BS
//   out           [T, H, D]             rows outside every chunk (decode rows) are zero
//
// Query i of chunk p sits at position ctx + i and sees keys 0 .. ctx + i (its cached context,
// then causally its own chunk, whose K/V the caller has already written into the cache). Query
// head h reads kv head h / G (G = H / Hkv). Everything accumulates in float32.
//
// Flash-attention style. A work item is 32 "lanes" of one (chunk, kv head): the chunk's
// (query token, group head) pairs flattened token-major, so lane u is token u / G, head u % G
// (with GQA the G heads of a token share its keys, and no lane is wasted whatever G is). The
// item walks the keys it may see in tiles of 64: S^T = K Q^T, online softmax, O += P V.
// Lanes run along the vector registers, which keeps everything vertical:
//   - Q is transposed once per item into [D][32 lanes] (bfloat16: [D/2][32] pairs), and each
//     score vector S^T[key][16 lanes] is a chain of FMAs (dpbf16) with K elements broadcast
//     straight from the cache row: no K copy or transpose;
//   - the softmax max / sum per lane are lane-wise max / add over keys: no horizontal sums;
//   - O [32 lanes][D] accumulates rows of V (float32: straight from the cache; bfloat16: two
//     keys' rows interleaved into dpbf16 pairs, a cheap unpack) times a broadcast probability.
// bfloat16 uses _mm512_dpbf16_ps: q and k are bfloat16, so the products are exact in float32.
// The probabilities are rounded to bfloat16 for P V (as torch's flash kernel does); their sum
// is kept in float32. The causal mask is applied only in tiles that reach past the first
// lane's position; keys past the item's last lane's position are never read, and neither
// are slots past context + query_len, so stale or NaN cache slots cannot leak in.
//
// AVX2 (the avx2 tier, and bfloat16 on AVX-512 without AVX512_BF16): lane by lane like the
// portable item, with the dot products, exponentials and P V rows 8 floats wide (K and V
// widened in registers), for any head_dim that is a multiple of 8.
//
// Work split: items (chunk, kv head, lane tile) are handed out one at a time from a shared
// counter (see for_items).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "vec_avx2.h"

namespace {

#define KVS_INLINE inline __attribute__((always_inline))
#define KVS_NOINLINE __attribute__((noinline))  // see fused.cpp

constexpr int64_t kLanes = 32;    // (token, head) rows per work item: two 16-lane vectors
constexpr int64_t kKeyTile = 64;  // keys per online-softmax step

struct Params {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* ctx;
  const int64_t* tables;
  int64_t num_chunks, num_kv_heads, groups, head_dim, block_size;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;  // same for K and V
  int64_t table_stride;
  float scale;
};

// One work item: lanes [u0, u0 + 32) (clipped to the chunk) of kv head kh of chunk p.
struct Item {
  int64_t p, kh, u0;
  bool cold;   // the first item of its (chunk, kv head): its K/V may not be in any cache yet
};

// What every implementation needs to know about an item.
struct ItemGeom {
  int64_t start, ctx, lanes, kmax, kfree;
  int32_t pos[kLanes];      // query position of each lane (padding lanes repeat the last one)
  int64_t q_off[kLanes];    // element offset of each lane's query row in q
  int64_t out_off[kLanes];  // ... and of its output row
};

inline ItemGeom geometry(const Params& P, const Item& it) {
  ItemGeom g;
  const int64_t G = P.groups;
  g.start = P.starts[it.p];
  g.ctx = P.ctx[it.p];
  const int64_t u1 = std::min(it.u0 + kLanes, P.lens[it.p] * G);
  g.lanes = u1 - it.u0;
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    const int64_t u = std::min(it.u0 + lane, u1 - 1);
    const int64_t tok = u / G, head = it.kh * G + u % G;
    g.pos[lane] = static_cast<int32_t>(g.ctx + tok);
    g.q_off[lane] = (g.start + tok) * P.q_stride_t + head * P.q_stride_h;
    g.out_off[lane] = (g.start + tok) * P.out_stride_t + head * P.out_stride_h;
  }
  g.kmax = g.ctx + (u1 - 1) / G + 1;       // keys [0, kmax) are read
  g.kfree = g.ctx + it.u0 / G + 1;         // keys [0, kfree) are visible to every lane
  return g;
}

// Element offset of key position j of chunk p, kv head kh (K and V alike).
KVS_INLINE int64_t key_offset(const Params& P, int64_t p, int64_t kh, int64_t j) {
  const int64_t blk = P.tables[p * P.table_stride + j / P.block_size];
  return blk * P.kv_stride_block + (j % P.block_size) * P.kv_stride_token + kh * P.kv_stride_head;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// ------------------------------------------------------------------------------------------
// Portable item (any head_dim, any ISA): lane by lane, scores for all its keys, then softmax.

struct GenericScratch {
  std::vector<float> q, s, o;
  explicit GenericScratch(int64_t D) : q(D), o(D) {}
};

template <typename T>
void generic_item(const Params& P, const Item& it, GenericScratch& sc) {
  const ItemGeom g = geometry(P, it);
  const int64_t D = P.head_dim;
  const T* Q = static_cast<const T*>(P.q);
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  T* O = static_cast<T*>(P.out);
  sc.s.resize(g.kmax);
  for (int64_t lane = 0; lane < g.lanes; ++lane) {
    const int64_t nkeys = g.pos[lane] + 1;
    for (int64_t d = 0; d < D; ++d) sc.q[d] = to_float(Q[g.q_off[lane] + d]);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < nkeys; ++j) {
      const T* kr = K + key_offset(P, it.p, it.kh, j);
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += sc.q[d] * to_float(kr[d]);
      sc.s[j] = dot * P.scale;
      mx = std::max(mx, sc.s[j]);
    }
    float sum = 0.f;
    std::fill(sc.o.begin(), sc.o.end(), 0.f);
    for (int64_t j = 0; j < nkeys; ++j) {
      const float p = std::exp(sc.s[j] - mx);
      sum += p;
      const T* vr = V + key_offset(P, it.p, it.kh, j);
      for (int64_t d = 0; d < D; ++d) sc.o[d] += p * to_float(vr[d]);
    }
    for (int64_t d = 0; d < D; ++d) O[g.out_off[lane] + d] = static_cast<T>(sc.o[d] / sum);
  }
}

// ------------------------------------------------------------------------------------------
// AVX2 item: head_dim a multiple of 8; same steps as generic_item, vectorised along D, with the
// keys as the outer loop: each K / V row is read once for all the item's lanes that see it,
// not once per lane. A short chunk on a long context (speculative decoding's 1 + k tokens
// verified on a 512-token context) read its whole K/V once per query row before, ~4x the time
// of one decode. Every lane still takes its keys in order, so the result is what the
// lane-by-lane loop computed, bit for bit.

#if defined(KVS_AVX2)
struct Avx2Scratch {
  // [lanes][D] query rows, [lanes][kmax] scores, [lanes][D] out, [lanes] 1 / softmax sum
  std::vector<float> q, s, o, inv;
};

template <typename T>
void avx2_item(const Params& P, const Item& it, Avx2Scratch& sc) {
  using namespace kvs_avx2;
  const ItemGeom g = geometry(P, it);
  const int64_t D = P.head_dim, L = g.lanes, n = g.kmax;
  const T* Q = static_cast<const T*>(P.q);
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  T* O = static_cast<T*>(P.out);
  sc.q.resize(L * D);
  sc.s.resize(L * n);
  sc.o.assign(L * D, 0.f);
  sc.inv.resize(L);
  float* const q = sc.q.data();
  float* const s = sc.s.data();
  float* const o = sc.o.data();
  for (int64_t lane = 0; lane < L; ++lane)
    for (int64_t d = 0; d < D; ++d) q[lane * D + d] = to_float(Q[g.q_off[lane] + d]);
  // Lanes are token-major, so their positions never decrease: the lanes that see key j are
  // those from first(j) on.
  int64_t first = 0;
  for (int64_t j = 0; j < n; ++j) {
    while (g.pos[first] < j) ++first;
    const T* kr = K + key_offset(P, it.p, it.kh, j);
    for (int64_t lane = first; lane < L; ++lane)
      s[lane * n + j] = dot8(q + lane * D, kr, D) * P.scale;
  }
  float* const inv = sc.inv.data();
  for (int64_t lane = 0; lane < L; ++lane) {
    float* const sl = s + lane * n;
    const int64_t nkeys = g.pos[lane] + 1;
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nkeys; ++j) vmax = _mm256_max_ps(vmax, _mm256_set1_ps(sl[j]));
    inv[lane] = 1.f / exp_sum(sl, nkeys, hmax8(vmax));
  }
  first = 0;
  for (int64_t j = 0; j < n; ++j) {
    while (g.pos[first] < j) ++first;
    const T* vr = V + key_offset(P, it.p, it.kh, j);
    for (int64_t lane = first; lane < L; ++lane) {
      const __m256 p = _mm256_set1_ps(s[lane * n + j]);
      float* const ol = o + lane * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(ol + d, _mm256_fmadd_ps(p, load8(vr + d), _mm256_loadu_ps(ol + d)));
    }
  }
  for (int64_t lane = 0; lane < L; ++lane) {
    const __m256 vinv = _mm256_set1_ps(inv[lane]);
    for (int64_t d = 0; d < D; d += 8)
      store8(O + g.out_off[lane] + d, _mm256_mul_ps(_mm256_loadu_ps(o + lane * D + d), vinv));
  }
}
#endif

// ------------------------------------------------------------------------------------------
// AVX-512 item: head_dim = 16 * NV.

#if defined(__AVX512F__)

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVS_HAVE_DPBF16 1
#endif

// 2^x for x <= 0 (softmax arguments, log2(e) folded into the scale): 2^n * P(r), n = round(x),
// |r| <= 1/2, P the degree-6 Taylor polynomial of e^(r ln 2) (relative error ~1e-7). Arguments
// below -126 are clamped (result ~1e-38, not 0). After exp16 in paged_attention.cpp, minus
// the multiply by log2(e) and the two-part ln 2 reduction.
KVS_INLINE __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);             // ln2^6 / 720
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-3f));   // ln2^5 / 120
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-3f));   // ln2^4 / 24
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-2f));   // ln2^3 / 6
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-1f));   // ln2^2 / 2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-1f));   // ln2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

KVS_INLINE uint32_t load_u32(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// A P V pass keeps R lanes x C accumulator vectors (C of a row's NV) in 16 registers, and loads
// C value vectors per key (pair) for R lanes: with all NV vectors of a 128-wide row and only
// 2 lanes, the value rows came from L2 twice as often as the FMAs could use them.
template <int NV>
constexpr int pv_cols() {
  return NV % 4 == 0 ? 4 : 2;
}

template <typename T, int NV>
struct Avx512Item {
  static constexpr int64_t D = 16 * NV;
  static constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  static constexpr int C = pv_cols<NV>();
  static constexpr int R = 16 / C;
  static_assert(!kBf16 || NV % 2 == 0, "bfloat16 rows are interleaved 32 elements at a time");

  // Per-thread scratch, float-sized words. qt: float32 [D][32] or bf16 pairs [D/2][32];
  // s: scores / probabilities [64 keys][32]; pp: bf16 probability pairs [32 key pairs][32];
  // vv: bf16 value pairs [32 key pairs][D] (in acc order); o: [32][D] (in acc order).
  struct Scratch {
    alignas(64) float qt[D * kLanes];
    alignas(64) float s[kKeyTile * kLanes];
    alignas(64) uint32_t pp[kKeyTile / 2 * kLanes];
    alignas(64) uint32_t vv[kKeyTile / 2 * D];
    alignas(64) float o[kLanes * D];
    alignas(64) float m[kLanes], l[kLanes], alpha[kLanes];
    alignas(64) T zero_row[D];
    const T* krow[kKeyTile];
    const T* vrow[kKeyTile];
    const T* knext[kKeyTile];
    const T* vnext[kKeyTile];
  };

  // O's element order. bfloat16: value pairs come from _mm512_unpack{lo,hi}_epi16, which
  // interleave within 128-bit lanes, so of each 32 elements of a row the first accumulator
  // holds d = {0-3, 8-11, 16-19, 24-27} and the second the other four of each eight; the
  // output store puts them back in order. float32: natural order.

  // S^T[n][lanes] for keys n = j .. j + NK of the tile (raw q.k, scale not applied), and the
  // running max of each lane vector. Masked: keys past a lane's position score -inf.
  template <int NK, bool Masked>
  static KVS_INLINE void qk(const T* const* krow, const float* qt, float* s, int64_t j,
                            const __m512i (&vpos)[2], __m512 (&mx)[2]) {
    __m512 a0[NK], a1[NK];
    for (int k = 0; k < NK; ++k) a0[k] = a1[k] = _mm512_setzero_ps();
    if constexpr (kBf16) {
#if defined(KVS_HAVE_DPBF16)
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        const __m512bh q0 = (__m512bh)_mm512_load_si512(qt + dp * kLanes);
        const __m512bh q1 = (__m512bh)_mm512_load_si512(qt + dp * kLanes + 16);
        for (int k = 0; k < NK; ++k) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(
              load_u32(krow[k] + 2 * dp)));
          a0[k] = _mm512_dpbf16_ps(a0[k], b, q0);
          a1[k] = _mm512_dpbf16_ps(a1[k], b, q1);
        }
      }
#endif
    } else {
      for (int64_t d = 0; d < D; ++d) {
        const __m512 q0 = _mm512_load_ps(qt + d * kLanes);
        const __m512 q1 = _mm512_load_ps(qt + d * kLanes + 16);
        for (int k = 0; k < NK; ++k) {
          const __m512 b = _mm512_set1_ps(to_float(krow[k][d]));
          a0[k] = _mm512_fmadd_ps(b, q0, a0[k]);
          a1[k] = _mm512_fmadd_ps(b, q1, a1[k]);
        }
      }
    }
    for (int k = 0; k < NK; ++k) {
      if constexpr (Masked) {
        const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        const __m512i key = _mm512_set1_epi32(static_cast<int>(j + k));
        a0[k] = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(key, vpos[0]), a0[k]);
        a1[k] = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(key, vpos[1]), a1[k]);
      }
      mx[0] = _mm512_max_ps(mx[0], a0[k]);
      mx[1] = _mm512_max_ps(mx[1], a1[k]);
      _mm512_store_ps(s + k * kLanes, a0[k]);
      _mm512_store_ps(s + k * kLanes + 16, a1[k]);
    }
  }

  template <bool Masked>
  static KVS_INLINE void scores(Scratch& sc, const ItemGeom& g, int64_t j0, int64_t nk,
                                __m512 (&mx)[2]) {
    const __m512i vpos[2] = {_mm512_loadu_si512(g.pos), _mm512_loadu_si512(g.pos + 16)};
    int64_t n = 0;
    for (; n + 8 <= nk; n += 8)
      qk<8, Masked>(sc.krow + n, sc.qt, sc.s + n * kLanes, j0 + n, vpos, mx);
    for (; n + 4 <= nk; n += 4)
      qk<4, Masked>(sc.krow + n, sc.qt, sc.s + n * kLanes, j0 + n, vpos, mx);
    for (; n < nk; ++n) qk<1, Masked>(sc.krow + n, sc.qt, sc.s + n * kLanes, j0 + n, vpos, mx);
  }

  // O[lane0 .. lane0 + R)[c0 .. c0 + C vectors) = alpha * O + P V over the tile's nk keys.
  static KVS_INLINE void pv(Scratch& sc, int64_t lane0, int c0, int64_t nk) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(sc.alpha[lane0 + r]);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_mul_ps(a, _mm512_load_ps(sc.o + (lane0 + r) * D + 16 * (c0 + c)));
    }
    if constexpr (kBf16) {
#if defined(KVS_HAVE_DPBF16)
      for (int64_t np = 0; np < (nk + 1) / 2; ++np) {
        __m512bh vv[C];
        for (int c = 0; c < C; ++c) {
          vv[c] = (__m512bh)_mm512_load_si512(sc.vv + np * D + 16 * (c0 + c));
          // Keep the row in a register: GCC otherwise reloads it for every dpbf16.
          __asm__("" : "+v"(vv[c]));
        }
        for (int r = 0; r < R; ++r) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(sc.pp[np * kLanes + lane0 + r]));
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
        }
      }
#endif
    } else {
      for (int64_t n = 0; n < nk; ++n) {
        __m512 vv[C];
        const float* vr = reinterpret_cast<const float*>(sc.vrow[n]) + 16 * c0;
        for (int c = 0; c < C; ++c) {
          vv[c] = _mm512_loadu_ps(vr + 16 * c);
          __asm__("" : "+v"(vv[c]));
        }
        for (int r = 0; r < R; ++r) {
          const __m512 p = _mm512_set1_ps(sc.s[n * kLanes + lane0 + r]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        _mm512_store_ps(sc.o + (lane0 + r) * D + 16 * (c0 + c), acc[r][c]);
  }

  // Online softmax step over the tile's scores (in place: s becomes p), lane-wise, given the
  // tile's new running max mx (raw scores). Masked tiles zero the -inf scores exactly.
  template <bool Masked>
  static KVS_INLINE void softmax(Scratch& sc, int64_t nk, const __m512 (&mx)[2], float scale) {
    // e^(scale (s - m)) = 2^(scale log2(e) (s - m)).
    const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int h = 0; h < 2; ++h) {
      const __m512 m_old = _mm512_load_ps(sc.m + 16 * h);
      // The first tile holds key 0, which every lane sees: mx is finite from then on, and
      // alpha = 2^-inf ~ 0 scales the empty accumulators of the first tile.
      const __m512 alpha = exp2_16(_mm512_mul_ps(_mm512_sub_ps(m_old, mx[h]), vscale));
      _mm512_store_ps(sc.alpha + 16 * h, alpha);
      _mm512_store_ps(sc.m + 16 * h, mx[h]);
      const __m512 mxs = _mm512_mul_ps(mx[h], vscale);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t n = 0; n < nk; ++n) {
        float* sp = sc.s + n * kLanes + 16 * h;
        const __m512 x = _mm512_load_ps(sp);
        __m512 p = exp2_16(_mm512_fmsub_ps(x, vscale, mxs));
        // exp2_16 clamps (~1e-38, not 0): masked keys must weigh exactly nothing.
        if constexpr (Masked) p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), p);
        _mm512_store_ps(sp, p);
        sum = _mm512_add_ps(sum, p);
      }
      const __m512 l = _mm512_load_ps(sc.l + 16 * h);
      _mm512_store_ps(sc.l + 16 * h, _mm512_fmadd_ps(l, alpha, sum));
    }
  }

#if defined(KVS_HAVE_DPBF16)
  // bfloat16: probabilities of keys (2i, 2i+1) as one dpbf16 pair per lane, and the value rows
  // of keys (2i, 2i+1) interleaved element by element (a padding key reads zeros).
  static KVS_INLINE void pack_pairs(Scratch& sc, int64_t nk) {
    const __m512i interleave = _mm512_setr_epi32(
        0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006,
        0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D,
        0x001E000E, 0x001F000F);   // words 0, 16, 1, 17, ...: lo[i], hi[i] pairs
    for (int64_t np = 0; np < (nk + 1) / 2; ++np) {
      const int64_t n0 = 2 * np, n1 = 2 * np + 1;
      for (int64_t h = 0; h < kLanes; h += 16) {
        const __m512 lo = _mm512_load_ps(sc.s + n0 * kLanes + h);
        const __m512 hi = n1 < nk ? _mm512_load_ps(sc.s + n1 * kLanes + h) : _mm512_setzero_ps();
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);   // lo in words 0-15
        _mm512_store_si512(sc.pp + np * kLanes + h, _mm512_permutexvar_epi16(interleave, both));
      }
      const T* a = sc.vrow[n0];
      const T* b = n1 < nk ? sc.vrow[n1] : sc.zero_row;
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(a + 32 * c);
        const __m512i y = _mm512_loadu_si512(b + 32 * c);
        _mm512_store_si512(sc.vv + np * D + 32 * c, _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(sc.vv + np * D + 32 * c + 16, _mm512_unpackhi_epi16(x, y));
      }
    }
  }
#endif

  static void run(const Params& P, const Item& it, Scratch& sc) {
    const ItemGeom g = geometry(P, it);
    const T* Q = static_cast<const T*>(P.q);
    const T* K = static_cast<const T*>(P.k);
    const T* V = static_cast<const T*>(P.v);
    const int64_t* table = P.tables + it.p * P.table_stride;
    const int64_t head_off = it.kh * P.kv_stride_head;
    // Row pointers of keys [j0, j0 + nk), block by block (no division per key).
    auto tile_rows = [&](int64_t j0, int64_t nk, const T** krow, const T** vrow) {
      for (int64_t n = 0, b = j0 / P.block_size, o = j0 % P.block_size; n < nk; ++b, o = 0) {
        const int64_t base = table[b] * P.kv_stride_block + head_off;
        for (; o < P.block_size && n < nk; ++o, ++n) {
          krow[n] = K + base + o * P.kv_stride_token;
          vrow[n] = V + base + o * P.kv_stride_token;
        }
      }
    };
    // A cold item's rows are fetched a tile ahead: blocks are scattered and a head's rows are
    // Hkv * D apart, which the hardware prefetchers do not follow (measured: f32 chunks whose
    // cache exceeds L3 ran 25-35% slower without).
    auto prefetch_tile = [&](int64_t j0) {
      const int64_t nk = std::min(kKeyTile, g.kmax - j0);
      tile_rows(j0, nk, sc.knext, sc.vnext);
      for (int64_t n = 0; n < nk; ++n)
        for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(sc.knext[n]) + off, 0, 3);
          __builtin_prefetch(reinterpret_cast<const char*>(sc.vnext[n]) + off, 0, 3);
        }
    };
    if (it.cold) prefetch_tile(0);
    // Q transposed, padding lanes zero: one gather per 16 lanes and 4 bytes of their rows
    // (a scalar loop cost ~10% on a mix of short chunks). q is at most 2 GB (checked).
    {
      const char* qb = reinterpret_cast<const char*>(Q);
      constexpr int64_t kBytes = static_cast<int64_t>(sizeof(T));
      __m512i idx[2];
      __mmask16 live[2];
      for (int h = 0; h < 2; ++h) {
        alignas(64) int32_t off[16];
        for (int i = 0; i < 16; ++i) off[i] = static_cast<int32_t>(g.q_off[16 * h + i] * kBytes);
        idx[h] = _mm512_load_si512(off);
        const int64_t n = std::clamp<int64_t>(g.lanes - 16 * h, 0, 16);
        live[h] = static_cast<__mmask16>((1u << n) - 1u);
      }
      for (int64_t w = 0; w < D * kBytes / 4; ++w)   // 4-byte words of a row
        for (int h = 0; h < 2; ++h) {
          const __m512i x = _mm512_mask_i32gather_epi32(
              _mm512_setzero_si512(), live[h], _mm512_add_epi32(idx[h], _mm512_set1_epi32(4 * w)),
              qb, 1);
          _mm512_store_si512(sc.qt + w * kLanes + 16 * h, x);
        }
    }
    std::fill(sc.o, sc.o + kLanes * D, 0.f);
    std::fill(sc.m, sc.m + kLanes, -std::numeric_limits<float>::infinity());
    std::fill(sc.l, sc.l + kLanes, 0.f);
    const int64_t active = (g.lanes + R - 1) / R * R;   // lanes whose O is accumulated

    for (int64_t j0 = 0; j0 < g.kmax; j0 += kKeyTile) {
      const int64_t nk = std::min(kKeyTile, g.kmax - j0);
      tile_rows(j0, nk, sc.krow, sc.vrow);
      if (it.cold && j0 + kKeyTile < g.kmax) prefetch_tile(j0 + kKeyTile);
      __m512 mx[2] = {_mm512_load_ps(sc.m), _mm512_load_ps(sc.m + 16)};
      if (j0 + nk > g.kfree) {   // some key is past some lane's position
        scores<true>(sc, g, j0, nk, mx);
        softmax<true>(sc, nk, mx, P.scale);
      } else {
        scores<false>(sc, g, j0, nk, mx);
        softmax<false>(sc, nk, mx, P.scale);
      }
#if defined(KVS_HAVE_DPBF16)
      if constexpr (kBf16) pack_pairs(sc, nk);
#endif
      for (int c0 = 0; c0 < NV; c0 += C)
        for (int64_t lane0 = 0; lane0 < active; lane0 += R) pv(sc, lane0, c0, nk);
    }

    T* O = static_cast<T*>(P.out);
    for (int64_t lane = 0; lane < g.lanes; ++lane) {
      const __m512 inv = _mm512_set1_ps(1.f / sc.l[lane]);
      const float* o = sc.o + lane * D;
      T* dst = O + g.out_off[lane];
      if constexpr (kBf16) {
#if defined(KVS_HAVE_DPBF16)
        // Undo the unpack order (see pos()): 4-element runs alternate between the halves.
        const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                             23);
        const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                             30, 31);
        for (int c = 0; c < NV / 2; ++c) {
          const __m512 a = _mm512_load_ps(o + 32 * c), b = _mm512_load_ps(o + 32 * c + 16);
          const __m512 x = _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), inv);
          const __m512 y = _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), inv);
          _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(y, x));
        }
#endif
      } else {
        for (int c = 0; c < NV; ++c)
          _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16 * c,
                           _mm512_mul_ps(_mm512_load_ps(o + 16 * c), inv));
      }
    }
  }
};

#endif  // __AVX512F__

// ------------------------------------------------------------------------------------------
// Items, ordered (chunk, kv head, lane tile from the last, most expensive, down): consecutive
// items reread the same K/V. Threads take items one at a time from a shared counter rather than
// fixed shares: on these shared 2-core machines one thread is often descheduled for a while,
// and a static split would then wait for it. Each item's result does not depend on which
// thread computes it.

std::vector<Item> make_items(const Params& P, int64_t& work) {
  std::vector<Item> items;
  const int64_t G = P.groups;
  work = 0;
  for (int64_t p = 0; p < P.num_chunks; ++p) {
    const int64_t U = P.lens[p] * G;
    const int64_t tiles = (U + kLanes - 1) / kLanes;
    work += P.num_kv_heads * U * (P.ctx[p] + P.lens[p]);
    for (int64_t kh = 0; kh < P.num_kv_heads; ++kh)
      for (int64_t t = tiles - 1; t >= 0; --t) items.push_back({p, kh, t * kLanes, t == tiles - 1});
  }
  return items;
}

template <typename Fn>
void for_items(const Params& P, Fn&& make_worker) {
  int64_t work = 0;   // ~ (lane, key) pairs, to decide how many threads are worth waking
  const std::vector<Item> items = make_items(P, work);
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  // Waking a second thread costs more than a tiny call's work (~10-20 us here). 4096 (lane, key)
  // pairs are ~80 us of one thread on the AVX2 EPYC; the earlier 32768 kept a 5-token chunk on
  // a 512-token context (speculative decoding's verification, 12 kv heads) on one thread:
  // 1.7 ms per layer against 0.6-0.9 ms on two (and the keys-outer AVX2 item).
  constexpr int64_t kMinWorkPerThread = 4096;
  const int64_t threads = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), n, work / kMinWorkPerThread}));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto run_item = make_worker();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      run_item(items[i]);
  });
}

template <typename T>
void run_generic(const Params& P) {
  for_items(P, [&] {
    return [&P, sc = GenericScratch(P.head_dim)](const Item& it) mutable {
      generic_item<T>(P, it, sc);
    };
  });
}

#if defined(KVS_AVX2)
template <typename T>
void run_avx2(const Params& P) {
  for_items(P, [&] {
    return [&P, sc = Avx2Scratch()](const Item& it) mutable { avx2_item<T>(P, it, sc); };
  });
}
#endif

#if defined(__AVX512F__)
template <typename T, int NV>
void run_avx512(const Params& P) {
  using Impl = Avx512Item<T, NV>;
  for_items(P, [&] {
    // ~50-150 KB: on the heap, one per thread.
    auto sc = std::make_unique<typename Impl::Scratch>();
    std::fill(sc->zero_row, sc->zero_row + Impl::D, T(0.f));
    return [&P, sc = std::move(sc)](const Item& it) { Impl::run(P, it, *sc); };
  });
}
#endif

template <typename T>
KVS_NOINLINE void dispatch(const Params& P) {
#if defined(__AVX512F__)
  constexpr bool vector_ok =
#if defined(KVS_HAVE_DPBF16)
      true;
#else
      std::is_same_v<T, float>;
#endif
  if constexpr (vector_ok) {
    switch (P.head_dim) {
      case 32: return run_avx512<T, 2>(P);
      case 64: return run_avx512<T, 4>(P);
      case 96: return run_avx512<T, 6>(P);
      case 128: return run_avx512<T, 8>(P);
      case 256: return run_avx512<T, 16>(P);
      default: break;
    }
  }
#endif
#if defined(KVS_AVX2)
  if (P.head_dim % 8 == 0) return run_avx2<T>(P);
#endif
  run_generic<T>(P);
}

at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& kv_cache,
                                   const at::Tensor& starts_in, const at::Tensor& lens_in,
                                   const at::Tensor& ctx_in, const at::Tensor& tables_in,
                                   double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && kv_cache.device().is_cpu(),
              "paged_prefill_attention (C++): CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3, "q must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q_in.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache's last dimension must be contiguous");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D, "head_dim mismatch between q and kv_cache");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t NP = starts_in.numel();
  TORCH_CHECK(starts_in.dim() == 1 && lens_in.dim() == 1 && ctx_in.dim() == 1 &&
                  lens_in.numel() == NP && ctx_in.numel() == NP,
              "query_starts, query_lens and context_lens must be [num_chunks]");
  TORCH_CHECK(tables_in.dim() == 2 && tables_in.size(0) == NP,
              "block_tables must be [num_chunks, max_blocks]");
  at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  // The vector path addresses q rows with 32-bit byte offsets.
  if ((q.size(0) - 1) * q.stride(0) + (q.size(1) - 1) * q.stride(1) + q.size(2) >=
      (int64_t{1} << 31) / static_cast<int64_t>(q.element_size()) - 1)
    q = q.contiguous();
  TORCH_CHECK(q.numel() < (int64_t{1} << 31) / static_cast<int64_t>(q.element_size()),
              "paged_prefill_attention: q must be under 2 GB");
  const at::Tensor starts = starts_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const at::Tensor ctx = ctx_in.to(at::kLong).contiguous();
  const at::Tensor tables = tables_in.to(at::kLong).contiguous();
  const int64_t MB = tables.size(1);
  at::Tensor out = at::empty({T, H, D}, q.options());

  // Validate everything the kernel will read (nothing is checked inside the parallel region),
  // and find the rows no chunk covers: they are zeroed.
  std::vector<uint8_t> covered(T, 0);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* cx = ctx.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t p = 0; p < NP; ++p) {
    TORCH_CHECK(ln[p] >= 0 && cx[p] >= 0 && st[p] >= 0 && st[p] + ln[p] <= T, "chunk ", p,
                ": query rows [", st[p], ", ", st[p] + ln[p], ") with context ", cx[p],
                " do not fit in q's ", T, " rows");
    const int64_t total = cx[p] + ln[p];
    TORCH_CHECK(total <= std::numeric_limits<int32_t>::max(), "chunk ", p, " is too long");
    const int64_t used = (total + BS - 1) / BS;
    TORCH_CHECK(used <= MB, "chunk ", p, ": ", total, " tokens do not fit in ", MB,
                " blocks of ", BS);
    for (int64_t b = 0; b < used; ++b) {
      const int64_t blk = tb[p * MB + b];
      TORCH_CHECK(blk >= 0 && blk < NB, "paged_prefill_attention: block id ", blk,
                  " out of range [0, ", NB, ") for chunk ", p);
    }
    for (int64_t r = st[p]; r < st[p] + ln[p]; ++r) {
      TORCH_CHECK(!covered[r], "paged_prefill_attention: query row ", r,
                  " belongs to two chunks");
      covered[r] = 1;
    }
  }
  {
    auto* base = static_cast<char*>(out.data_ptr());
    const int64_t row_bytes = H * D * static_cast<int64_t>(out.element_size());
    for (int64_t r = 0; r < T; ++r)
      if (!covered[r]) std::memset(base + r * row_bytes, 0, row_bytes);
  }
  if (NP == 0 || T == 0 || H == 0 || D == 0) return out;

  Params P;
  P.q = q.data_ptr();
  P.out = out.data_ptr();
  P.k = kv_cache.select(0, 0).data_ptr();
  P.v = kv_cache.select(0, 1).data_ptr();
  P.starts = st;
  P.lens = ln;
  P.ctx = cx;
  P.tables = tb;
  P.num_chunks = NP;
  P.num_kv_heads = Hkv;
  P.groups = H / Hkv;
  P.head_dim = D;
  P.block_size = BS;
  P.q_stride_t = q.stride(0);
  P.q_stride_h = q.stride(1);
  P.out_stride_t = out.stride(0);
  P.out_stride_h = out.stride(1);
  P.kv_stride_block = kv_cache.stride(1);
  P.kv_stride_token = kv_cache.stride(2);
  P.kv_stride_head = kv_cache.stride(3);
  P.table_stride = MB;
  P.scale = static_cast<float>(scale);

  switch (q.scalar_type()) {
    case at::kFloat: dispatch<float>(P); break;
    case at::kBFloat16: dispatch<c10::BFloat16>(P); break;
    default: TORCH_CHECK(false, "paged_prefill_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

// Which vector path this build took, per dtype (logged by the Python side, checked by tests).
std::string isa() {
#if defined(KVS_HAVE_DPBF16)
  return "avx512 (f32 fma, bf16 dpbf16)";
#elif defined(__AVX512F__)
  return "avx512 (f32 fma, bf16 avx2)";
#elif defined(KVS_AVX2)
  return "avx2 (fma; bf16 widened in registers)";
#else
  return "generic";
#endif
}

}  // namespace

// A fragment: paged_attention.cpp owns TORCH_LIBRARY(kvserve), and a namespace may have only
// one of those per process.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor query_starts, "
        "Tensor query_lens, Tensor context_lens, Tensor block_tables, float scale) -> Tensor");
  m.def("paged_prefill_attention_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
