// Panel-packed bf16 experts for moe.cpp's fused_moe on dpbf16 builds (included inside its
// anonymous namespace, after Groups / for_chunks / split_by_expert / sum_rows).
//
//   w13 [E, 2I/16, H/2, 32]: panels of 16 output rows; panel 2j holds gate rows [16j, 16j+16),
//                            panel 2j+1 the up rows of the same intermediates; inside a panel,
//                            for each input pair kp, the 16 rows' (x[2kp], x[2kp+1]) weights
//   w2  [E, H/16, I/2, 32]:  the same for the down projection's 16-row blocks of hidden
//   (ops/moe.py pack_panels writes both; unpack_panels inverts them.)
//
// Why: the row layout's kernel (dots_dp) computes one dot product per accumulator and reduces
// it across lanes at the end, and re-reads the x rows for every 2-4 weight rows; it peaks at
// ~450 GFLOP/s in cache (2 Zen 5 cores) against oneDNN's ~900 for bf16 GEMMs. Here a lane IS an
// output row: a 6-row x 4-panel microkernel broadcasts one x pair to 4 weight vectors (24
// independent dpbf16 chains, 4 loads + 6 broadcasts each step) and never reduces across
// lanes; gate and up of the same 16 intermediates land in neighbouring accumulators, so
// SiLU(gate) * up is computed in registers. One kernel then serves every step size: prefill's
// ~256 rows an expert as well as decode's 1-16 (each output lane accumulates its K/2 pairs in
// order whatever the row count: a row's result does not depend on its batch).

#pragma once
// (Its includes, <cstring> and vec_avx512.h, are moe.cpp's: this file sits inside a namespace.)

constexpr int kPanelMR = 6;          // x rows per microkernel call
constexpr int kPanelNR = 4;          // panels per microkernel call (24 accumulators)
constexpr int64_t kPanelAhead = 16;  // pairs (1 KB of a panel) the software prefetch runs ahead

// acc[m][r] = dpbf16 sums over the KP pairs of x row m and panel r, lanes = the panel's rows.
template <int MR, int NR>
KVS_INLINE void panel_dots(const bf16* const* x, const bf16* const* w, int64_t KP,
                           __m512 (&acc)[MR][NR]) {
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      if (kp + kPanelAhead < KP)
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + (kp + kPanelAhead) * 32), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + kp * 32);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x[m] + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xb, wv[r]);
    }
  }
}

// float32 -> bf16, round to nearest even (as c10::BFloat16 and torch's casts round finite values).
KVS_INLINE void store_bf16x16(bf16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// Pass 1, MR pairs, intermediate blocks [j, j + NJ): act[m][16j ..] = silu(gate) * up, as bf16.
template <int MR, int NJ>
KVS_INLINE void gate_up_panels(const bf16* const* x, const bf16* w13e, bf16* const* act,
                               int64_t j, int64_t H) {
  const bf16* w[2 * NJ];
  for (int q = 0; q < 2 * NJ; ++q) w[q] = w13e + (2 * j + q) * H * kPanelRows;
  __m512 acc[MR][2 * NJ];
  panel_dots<MR, 2 * NJ>(x, w, H / 2, acc);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NJ; ++n) {
      const __m512 g = acc[m][2 * n];
      const __m512 neg_g = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, kvs_avx512::exp16(neg_g)));
      store_bf16x16(act[m] + (j + n) * kPanelRows,
                    _mm512_mul_ps(_mm512_mul_ps(g, sig), acc[m][2 * n + 1]));
    }
}

// Pass 2, MR pairs, hidden panels [b, b + NR): rows[m][16b ..] = weight_m * (w2 panel . act).
template <int MR, int NR>
KVS_INLINE void down_panels(const bf16* const* act, const bf16* w2e, float* const* out,
                            const float* wt, int64_t b, int64_t I) {
  const bf16* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = w2e + (b + r) * I * kPanelRows;
  __m512 acc[MR][NR];
  panel_dots<MR, NR>(act, w, I / 2, acc);
  for (int m = 0; m < MR; ++m) {
    const __m512 s = _mm512_set1_ps(wt[m]);
    for (int r = 0; r < NR; ++r)
      _mm512_storeu_ps(out[m] + (b + r) * kPanelRows, _mm512_mul_ps(s, acc[m][r]));
  }
}

// fn(NR constant, first unit) over units [u0, u1) in steps of up to N (a tail of 1..N-1).
template <int N, typename Fn>
KVS_INLINE void for_units(int64_t u0, int64_t u1, Fn&& fn) {
  int64_t u = u0;
  for (; u + N <= u1; u += N) fn(std::integral_constant<int, N>{}, u);
  if constexpr (N > 1) {
    if (u < u1) for_units<N - 1>(u, u1, fn);
  }
}

// Pass 1 for group gi over intermediate blocks [j0, j1): each 2-block step (4 panels, 2 * 16
// * H bf16: 128 KB at H = 1024) runs every chunk of the group's pairs before the next, so a
// panel is read from memory once and from L2 for the other chunks.
KVS_INLINE void gate_up_panel_group(const bf16* xf, const bf16* w13e, const Groups& g,
                                    int64_t gi, bf16* act, int64_t j0, int64_t j1, int64_t H,
                                    int64_t I) {
  for_units<kPanelNR / 2>(j0, j1, [&](auto nj, int64_t j) {
    constexpr int NJ = decltype(nj)::value;
    for_chunks<kPanelMR>(g.start[gi], g.start[gi + 1], [&](auto mb, int64_t p) {
      constexpr int MB = decltype(mb)::value;
      const bf16* x[MB];
      bf16* a[MB];
      for (int m = 0; m < MB; ++m) x[m] = xf + g.token[p + m] * H, a[m] = act + (p + m) * I;
      gate_up_panels<MB, NJ>(x, w13e, a, j, H);
    });
  });
}

// Pass 2 for group gi over hidden panels [b0, b1).
KVS_INLINE void down_panel_group(const bf16* act, const bf16* w2e, const Groups& g, int64_t gi,
                                 float* rows, int64_t b0, int64_t b1, int64_t H, int64_t I) {
  for_units<kPanelNR>(b0, b1, [&](auto nr, int64_t b) {
    constexpr int NR = decltype(nr)::value;
    for_chunks<kPanelMR>(g.start[gi], g.start[gi + 1], [&](auto mb, int64_t p) {
      constexpr int MB = decltype(mb)::value;
      const bf16* a[MB];
      float* o[MB];
      for (int m = 0; m < MB; ++m) a[m] = act + (p + m) * I, o[m] = rows + (p + m) * H;
      down_panels<MB, NR>(a, w2e, o, g.weight.data() + p, b, I);
    });
  });
}

// sum_rows for bf16 out (H a multiple of 16): each token's sum in float32, in the same order
// from the same zero, rounded once as torch's cast rounds (one pass, no float32 [T, H] copy).
KVS_NOINLINE void sum_rows_bf16(const Groups& g, const float* rows, bf16* out, int64_t T,
                                int64_t k, int64_t H) {
  over_tokens(g, T, k, H, [&](int64_t t0, int64_t t1, const std::vector<int64_t>& pairs_of) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; h += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; ++c)
          acc = _mm512_add_ps(acc, _mm512_loadu_ps(rows + pairs_of[t * k + c] * H + h));
        store_bf16x16(out + t * H + h, acc);
      }
  });
}

// Both passes over the panel-packed stacks, split by expert or by output panels (as run /
// run_by_expert: the same dot products either way, bit-identical results).
KVS_NOINLINE void run_panels(bool by_expert, const bf16* xf, const bf16* w13, const bf16* w2,
                             const Groups& g, bf16* act, float* rows, int64_t H, int64_t I) {
  const int64_t G = static_cast<int64_t>(g.expert.size());
  const int64_t J = I / kPanelRows, B = H / kPanelRows;
  auto w13e = [&](int64_t gi) { return w13 + g.expert[gi] * 2 * I * H; };
  auto w2e = [&](int64_t gi) { return w2 + g.expert[gi] * H * I; };
  if (by_expert) {
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t gi = g0; gi < g1; ++gi) {
        gate_up_panel_group(xf, w13e(gi), g, gi, act, 0, J, H, I);
        down_panel_group(act, w2e(gi), g, gi, rows, 0, B, H, I);
      }
    });
    return;
  }
  // Grains in whole microkernel steps (2 intermediate blocks, 4 hidden panels).
  const int64_t grain1 = std::max<int64_t>(
      2, kMinElemsPerTask / std::max<int64_t>(1, 2 * kPanelRows * H * G) / 2 * 2);
  at::parallel_for(0, J, grain1, [&](int64_t j0, int64_t j1) {
    for (int64_t gi = 0; gi < G; ++gi) gate_up_panel_group(xf, w13e(gi), g, gi, act, j0, j1, H, I);
  });
  const int64_t grain2 = std::max<int64_t>(
      4, kMinElemsPerTask / std::max<int64_t>(1, kPanelRows * I * G) / 4 * 4);
  at::parallel_for(0, B, grain2, [&](int64_t b0, int64_t b1) {
    for (int64_t gi = 0; gi < G; ++gi) down_panel_group(act, w2e(gi), g, gi, rows, b0, b1, H, I);
  });
}
