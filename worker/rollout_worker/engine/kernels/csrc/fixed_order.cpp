// Fixed-order float32 kernels for the deterministic kernels (issue 19), built on first use by
// rollout_worker.engine.kernels.fixed_order. Products (`partials`): each chunk's partial product, every output one chain
// of fused multiply-adds over the chunk's inputs in order, from zero; a vector's 16 lanes are 16 outputs
// (no sum across lanes), so an output's bits do not depend on the number of tokens, on where a token or an
// output falls in a tile, or on the other chunks: batch- and TP-invariant by construction. Products over a
// dense weight (`dense`): lanes over the inputs, added in one order. Attention (`attend`): every query row
// on its own, each of its sums in one fixed order.
//
// Built for AVX-512 (-mavx512f) or for AVX2 (-mavx2 -mfma): a vector V is 16 float lanes, one AVX-512
// register or two AVX2 ones, and every operation on it is the same lane by lane on both (fused
// multiply-adds, one rounding each; every sum across lanes adds the same pairs), so both builds compute
// the same bits. Only the tiles' shapes differ (AVX2 has 16 registers of 8 lanes, AVX-512 32 of 16), and
// no output's bits depend on its tile.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

constexpr int64_t LANES = 16, BLOCK = 64;  // lanes of a V; outputs per packed block (4 vectors)

#if defined(__AVX512F__)
constexpr const char* ISA = "avx512";
struct V { __m512 a; };
// the lanes of the first n (all from 16 on)
static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vset1(float x) { return {_mm512_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V vloadn(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
static inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v.a); }
static inline void vstoren(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), v.a); }
static inline V vfmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.a, b.a, c.a)}; }
static inline V vfnmadd(V a, V b, V c) { return {_mm512_fnmadd_ps(a.a, b.a, c.a)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.a, b.a)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.a, b.a)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.a, b.a)}; }
static inline V vdiv(V a, V b) { return {_mm512_div_ps(a.a, b.a)}; }
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.a, b.a)}; }
static inline V vround(V a) { return {_mm512_roundscale_ps(a.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n, n integral in [-126, 0] (exact powers of two: one rounding, as a product by 2^n)
static inline V vscale2(V a, V n) { return {_mm512_scalef_ps(a.a, n.a)}; }
// the lanes whose bit is set in m, zeros elsewhere
static inline V vkeep(V a, uint32_t m) { return {_mm512_maskz_mov_ps((__mmask16)m, a.a)}; }
// 256-bit halves: lanes 0-7 and 8-15
static inline __m256 vlo(V a) { return _mm512_castps512_ps256(a.a); }
static inline __m256 vhi(V a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.a), 1)); }
// 16 accumulators -> one vector of their 16 sums (sum k in lane k); every accumulator's lanes are added in
// the same order whatever its position k: (l + l+2) within 4-lane groups, the two pairs, the 128-bit
// groups 0+1 and 2+3, then those two
__attribute__((always_inline)) static inline V reduce16(const V* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].a, v[2 * i + 1].a), _mm512_unpackhi_ps(v[2 * i].a, v[2 * i + 1].a));
  for (int i = 0; i < 4; ++i) {
    __m512d s = _mm512_castps_pd(a[2 * i]), t = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(s, t)), _mm512_castpd_ps(_mm512_unpackhi_pd(s, t)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}
// the tiles: packed products TT_P tokens x 1 block (the rest 1 token x OB_R blocks); dense products TT_D x
// OT_D (the rest, 1 to 3 tokens, with ACC accumulators); attention's keys scored ACC at a time, its
// values' rows about ACC vectors at a time
constexpr int TT_P = 4, OB_R = 4, TT_D = 4, OT_D = 4, ACC = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* ISA = "avx2";
struct V { __m256 lo, hi; };  // lanes 0-7, 8-15
// per half: its lanes below n (n clamped to [0, 8])
static inline __m256i half_mask(int64_t n) {
  int m = (int)std::max<int64_t>(0, std::min<int64_t>(8, n));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V vloadn(const float* p, int64_t n) {
  if (n >= 16) return vload(p);
  return {_mm256_maskload_ps(p, half_mask(n)), _mm256_maskload_ps(p + 8, half_mask(n - 8))};
}
static inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline void vstoren(float* p, V v, int64_t n) {
  if (n >= 16) return vstore(p, v);
  _mm256_maskstore_ps(p, half_mask(n), v.lo);
  _mm256_maskstore_ps(p + 8, half_mask(n - 8), v.hi);
}
static inline V vfmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vfnmadd(V a, V b, V c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V vround(V a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
static inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127], built from its exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline V vscale2(V a, V n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
static inline V vkeep(V a, uint32_t m) {
  __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i lo = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(m & 0xFF)), bits), bits);
  __m256i hi = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(m >> 8)), bits), bits);
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lo)), _mm256_and_ps(a.hi, _mm256_castsi256_ps(hi))};
}
static inline __m256 vlo(V a) { return a.lo; }
static inline __m256 vhi(V a) { return a.hi; }
// reduce16 of the AVX-512 build, the same pairs added: the in-group steps work within 128-bit groups on
// either; the groups' sums (0+1, 2+3, then those two) pair the halves' groups with permutes
__attribute__((always_inline)) static inline V reduce16(const V* v) {
  V a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    const V &x = v[2 * i], &y = v[2 * i + 1];
    a[i] = {_mm256_add_ps(_mm256_unpacklo_ps(x.lo, y.lo), _mm256_unpackhi_ps(x.lo, y.lo)),
            _mm256_add_ps(_mm256_unpacklo_ps(x.hi, y.hi), _mm256_unpackhi_ps(x.hi, y.hi))};
  }
  auto pd_step = [](__m256 s, __m256 t) {
    __m256d sd = _mm256_castps_pd(s), td = _mm256_castps_pd(t);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(sd, td)), _mm256_castpd_ps(_mm256_unpackhi_pd(sd, td)));
  };
  for (int i = 0; i < 4; ++i) b[i] = {pd_step(a[2 * i].lo, a[2 * i + 1].lo), pd_step(a[2 * i].hi, a[2 * i + 1].hi)};
  // a V of groups [g0 g1 | g2 g3] -> [g0+g1 g2+g3] (256 bits)
  auto groups = [](V x) {
    return _mm256_add_ps(_mm256_permute2f128_ps(x.lo, x.hi, 0x20), _mm256_permute2f128_ps(x.lo, x.hi, 0x31));
  };
  V c[2] = {{groups(b[0]), groups(b[1])}, {groups(b[2]), groups(b[3])}};
  return {groups(c[0]), groups(c[1])};
}
constexpr int TT_P = 2, OB_R = 1, TT_D = 2, OT_D = 2, ACC = 4;
#else
#error "fixed_order.cpp needs AVX-512 (-mavx512f) or AVX2 with FMA (-mavx2 -mfma)"
#endif

// out[t, o] for TT tokens and OB blocks of 64 outputs: each (t, o) one chain of fused multiply-adds over k
// in order, from zero (a lane per output: no reduction across lanes). Token rows past the edge repeat the
// last one (computed, not stored); outputs at or past O (the packed weight's zero padding) are not stored.
template <int TT, int OB>
static inline void tile(const float* const* xr, const float* const* wb, int64_t K, float* const* outr,
                        int64_t o0, int64_t O, int tt) {
  V acc[TT][OB * 4];
  for (int i = 0; i < TT; ++i)
    for (int j = 0; j < OB * 4; ++j) acc[i][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V wv[OB * 4];
    for (int b = 0; b < OB; ++b)
      for (int v = 0; v < 4; ++v) wv[b * 4 + v] = vload(wb[b] + k * BLOCK + v * LANES);
    for (int i = 0; i < TT; ++i) {
      V xv = vset1(xr[i][k]);
      for (int j = 0; j < OB * 4; ++j) acc[i][j] = vfmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < tt; ++i)
    for (int j = 0; j < OB * 4; ++j) {
      int64_t o = o0 + j * LANES;
      if (o >= O) break;
      vstoren(outr[i] + o, acc[i][j], O - o);
    }
}

template <int TT, int OB>
static void tiles(const float* x, int64_t ldx, const float* wc, int64_t K, int64_t blocks, float* out,
                  int64_t O, int64_t t0, int64_t T) {
  for (int64_t b0 = 0; b0 < blocks; b0 += OB) {
    const float* wb[OB];
    for (int b = 0; b < OB; ++b) wb[b] = wc + std::min(b0 + b, blocks - 1) * K * BLOCK;
    for (int64_t t = t0; t < T; t += TT) {
      int tt = (int)std::min<int64_t>(TT, T - t);
      const float* xr[TT];
      float* outr[TT];
      for (int i = 0; i < TT; ++i) {
        xr[i] = x + (t + std::min(i, tt - 1)) * ldx;
        outr[i] = out + (t + std::min(i, tt - 1)) * O;
      }
      tile<TT, OB>(xr, wb, K, outr, b0 * BLOCK, std::min(O, (b0 + OB) * BLOCK), tt);
    }
  }
}

// w [O, n * width] -> [n, ceil(O / 64), width, 64]: chunk c's block b holds outputs [64 b, 64 b + 64) for
// each of its width inputs, zeros past O
torch::Tensor pack(torch::Tensor w, int64_t n) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && n > 0 && w.size(1) % n == 0,
              "pack: a float32 [out, n * width] weight");
  int64_t O = w.size(0), width = w.size(1) / n, blocks = (O + BLOCK - 1) / BLOCK;
  auto padded = torch::zeros({blocks * BLOCK, w.size(1)}, w.options());
  padded.narrow(0, 0, O).copy_(w);
  return padded.view({blocks, BLOCK, n, width}).permute({2, 0, 3, 1}).contiguous();
}

// x [T, n * width] (rows of stride ldx), packed [n, blocks, width, 64] -> [n, T, O]
torch::Tensor partials(torch::Tensor x, torch::Tensor packed, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.is_contiguous() && x.stride(1) == 1);
  int64_t n = packed.size(0), blocks = packed.size(1), width = packed.size(2), T = x.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "partials: float32");
  TORCH_CHECK(x.size(1) == n * width && O <= blocks * BLOCK && O > (blocks - 1) * BLOCK,
              "partials: x's width or O does not match the packed weight");
  auto out = torch::empty({n, T, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t full = T / TT_P * TT_P;
  pybind11::gil_scoped_release no_gil;
  for (int64_t c = 0; c < n; ++c) {
    const float* wc = wp + c * blocks * width * BLOCK;
    tiles<TT_P, 1>(xp + c * width, x.stride(0), wc, width, blocks, op + c * T * O, O, 0, full);
    tiles<1, OB_R>(xp + c * width, x.stride(0), wc, width, blocks, op + c * T * O, O, full, T);
  }
  return out;
}

// ---- attention: every query row on its own, each sum in one fixed order ----

// exp(x) for x <= 0 (a score less the row's maximum): n = round(x log2 e), r = x - n ln 2 (two steps),
// a degree-6 polynomial of r, scaled by 2^n; the same instructions for every element, so the same bits.
static inline V exp_le0(V x) {
  x = vmax(x, vset1(-87.0f));
  V n = vround(vmul(x, vset1(1.44269504088896341f)));
  V r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  V p = vset1(1.0f / 720);
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vscale2(p, n);
}

static inline float lanes_sum(V v) {  // one fixed order: the halves, their 128-bit halves, then pairs
  __m256 h = _mm256_add_ps(vlo(v), vhi(v));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// ---- products over a dense weight [O, K] as it is (no copy): lanes over K ----

// out[t, o] for TT tokens and OT outputs (TT * OT <= 16 accumulators): accumulator (t, o)'s lane l is one
// chain of fused multiply-adds over k = l, l + 16, ... in order, from zero (the last vector's lanes past K
// load zeros); its 16 lanes are then summed in reduce16's one order. An output's bits so depend on nothing
// but its row and the weight's: not on the tokens beside it, on TT or OT, or on where a tile falls. Rows of
// a tile past the edge repeat the last one (computed, not stored).
template <int TT, int OT>
__attribute__((always_inline)) static inline void dense_tile(const float* const* xr, const float* const* wr, int64_t K, float* const* outr,
                              int tt, int ot, int64_t ahead) {
  V acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = vzero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V wv[OT];
    for (int j = 0; j < OT; ++j) {
      wv[j] = vload(wr[j] + k);
      _mm_prefetch((const char*)(wr[j] + k + ahead), _MM_HINT_T1);
    }
    for (int i = 0; i < TT; ++i) {
      V xv = vload(xr[i] + k);
      for (int j = 0; j < OT; ++j) acc[i * OT + j] = vfmadd(xv, wv[j], acc[i * OT + j]);
    }
  }
  if (k < K) {
    V wv[OT];
    for (int j = 0; j < OT; ++j) wv[j] = vloadn(wr[j] + k, K - k);
    for (int i = 0; i < TT; ++i) {
      V xv = vloadn(xr[i] + k, K - k);
      for (int j = 0; j < OT; ++j) acc[i * OT + j] = vfmadd(xv, wv[j], acc[i * OT + j]);
    }
  }
  alignas(64) float sums[16];
  vstore(sums, reduce16(acc));
  for (int i = 0; i < tt; ++i)
    for (int j = 0; j < ot; ++j) outr[i][j] = sums[i * OT + j];
}

// chunk c's out [T, O] (chunks T * O apart) = x [T, n * width] (row stride ldx) times w [O, n * width] (row
// stride ldw), transposed, over columns [c * width, (c + 1) * width): tokens [t0, t1) in tiles of TT, outputs
// in tiles of OT, each tile's rows of w read for every chunk in turn (so each row is read in order) while
// the next tile's are prefetched
template <int TT, int OT>
static void dense_tiles(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t n, int64_t width,
                        float* out, int64_t O, int64_t t0, int64_t t1, int64_t T) {
  for (int64_t o = 0; o < O; o += OT) {
    int ot = (int)std::min<int64_t>(OT, O - o);
    const float* wr[OT];
    for (int64_t c = 0; c < n; ++c) {
      for (int j = 0; j < OT; ++j) wr[j] = w + (o + std::min(j, ot - 1)) * ldw + c * width;
      for (int64_t t = t0; t < t1; t += TT) {
        int tt = (int)std::min<int64_t>(TT, t1 - t);
        const float* xr[TT];
        float* outr[TT];
        for (int i = 0; i < TT; ++i) {
          xr[i] = x + (t + std::min(i, tt - 1)) * ldx + c * width;
          outr[i] = out + c * T * O + (t + i) * O + o;
        }
        // the rows' next chunk, or the next tile's first: read next, fetched meanwhile
        dense_tile<TT, OT>(xr, wr, width, outr, tt, ot, c + 1 < n ? width : OT * ldw - c * width);
      }
    }
  }
}

// x [T, n * width] (rows of unit stride), w [O, n * width] (rows of unit stride, any row stride) -> [n, T, O]:
// chunk c's product of x's and w's columns [c * width, (c + 1) * width), each output of each token as
// dense_tile computes it. TT_D tokens at a time (TT_D x OT_D outputs); the rest in one pass over w.
torch::Tensor dense(torch::Tensor x, torch::Tensor w, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.stride(1) == 1 && w.stride(1) == 1, "dense: 2-D, unit strides");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "dense: float32");
  TORCH_CHECK(n > 0 && w.size(1) % n == 0 && x.size(1) == w.size(1), "dense: x's width does not match w's");
  int64_t T = x.size(0), O = w.size(0), width = w.size(1) / n;
  auto out = torch::empty({n, T, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t full = T / TT_D * TT_D, ldx = x.stride(0), ldw = w.stride(0);
  pybind11::gil_scoped_release no_gil;
  dense_tiles<TT_D, OT_D>(xp, ldx, wp, ldw, n, width, op, O, 0, full, T);
  switch (T - full) {
    case 1: dense_tiles<1, ACC>(xp, ldx, wp, ldw, n, width, op, O, full, T, T); break;
    case 2: dense_tiles<2, ACC / 2>(xp, ldx, wp, ldw, n, width, op, O, full, T, T); break;
    case 3: dense_tiles<3, (ACC + 1) / 3>(xp, ldx, wp, ldw, n, width, op, O, full, T, T); break;
  }
  return out;
}

// the scores of one query row (q: hd floats, scaled) against keys [j0, j0 + 16) (rows of hd, stride ldk):
// per key the head dimension's 16 lanes summed over its vectors in order, then the lanes (reduce16). Keys
// at or past L repeat key j0 (computed, not stored).
static inline void score_keys(const float* q, const float* keys, int64_t ldk, int64_t hd, int64_t j0, int64_t L,
                              float* sc) {
  V acc[16];
  for (int g = 0; g < 16; g += ACC) {  // each key's chain is its own: a few keys at a time
    V part[ACC];
    const float* kr[ACC];
    for (int k = 0; k < ACC; ++k) {
      part[k] = vzero();
      kr[k] = keys + (j0 + g + k < L ? j0 + g + k : j0) * ldk;
    }
    for (int64_t d = 0; d < hd; d += 16) {
      V qv = vload(q + d);
      for (int k = 0; k < ACC; ++k) part[k] = vfmadd(qv, vload(kr[k] + d), part[k]);
    }
    for (int k = 0; k < ACC; ++k) acc[g + k] = part[k];
  }
  vstoren(sc + j0, reduce16(acc), L - j0);
}

// out rows = sum over keys j in order of e[r][j] * v[j] (a lane per head dimension), HV vectors of 16
template <int RT, int HV>
static inline void value_tile(const float* const* e, const float* vals, int64_t ldv, int64_t L, float* const* out,
                              const float* den) {
  V acc[RT][HV];
  for (int i = 0; i < RT; ++i)
    for (int v = 0; v < HV; ++v) acc[i][v] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    V vv[HV];
    for (int v = 0; v < HV; ++v) vv[v] = vload(vals + j * ldv + 16 * v);
    for (int i = 0; i < RT; ++i) {
      V ev = vset1(e[i][j]);
      for (int v = 0; v < HV; ++v) acc[i][v] = vfmadd(ev, vv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < RT; ++i) {
    V dv = vset1(den[i]);
    for (int v = 0; v < HV; ++v) vstore(out[i] + 16 * v, vdiv(acc[i][v], dv));
  }
}

template <int HV>
static void values_of(float* const* e, const float* vals, int64_t ldv, int64_t L, float* const* out,
                      const float* den, int64_t rows) {
  constexpr int RT = ACC / HV > 0 ? ACC / HV : 1;
  for (int64_t r0 = 0; r0 < rows; r0 += RT) {
    int rt = (int)std::min<int64_t>(RT, rows - r0);
    const float* er[RT];
    float* orow[RT];
    float dn[RT];
    alignas(64) float scratch[RT][16 * HV];
    for (int i = 0; i < RT; ++i) {
      int k = std::min(i, rt - 1);
      er[i] = e[r0 + k];
      dn[i] = den[r0 + k];
      orow[i] = i < rt ? out[r0 + i] : scratch[i];
    }
    value_tile<RT, HV>(er, vals, ldv, L, orow, dn);
  }
}

// q [B, S, H, hd], keys and vals [B, KVh, >= L, hd] (last stride 1),
// mask [B, S, L] (uint8: the keys each query row sees) -> [B, S, H * hd]. Query head h reads KV head
// h / (H / KVh). Every row's result is its own: bitwise the same whatever B, S, L past its last visible
// key, and the other rows.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor vals, torch::Tensor mask, double scale,
                     int64_t L) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && vals.scalar_type() == at::kFloat,
              "attend: float32");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && vals.dim() == 4 && mask.dim() == 3, "attend: shapes");
  TORCH_CHECK(keys.stride(3) == 1 && vals.stride(3) == 1 && mask.scalar_type() == at::kByte, "attend: layouts");
  q = q.contiguous();
  mask = mask.contiguous();
  int64_t B = q.size(0), S = q.size(1), H = q.size(2), hd = q.size(3), KVh = keys.size(1);
  TORCH_CHECK(H % KVh == 0 && hd % 16 == 0 && hd <= 128 && keys.size(3) == hd && vals.size(3) == hd,
              "attend: head layout");
  TORCH_CHECK(keys.size(2) >= L && vals.size(2) >= L && mask.size(2) >= L, "attend: fewer keys than L");
  int64_t G = H / KVh, rows = G * S, HV = hd / 16;
  auto out = torch::empty({B, S, H * hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = vals.data_ptr<float>();
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int64_t Lp = (L + 15) / 16 * 16;
  // rows in blocks (each row's work is its own): the scores' buffer is ROW_BLOCK x L, whatever a prefill's rows
  constexpr int64_t ROW_BLOCK = 64;
  int64_t nb_max = std::min(rows, ROW_BLOCK);
  std::vector<float> qbuf(nb_max * hd), sbuf(nb_max * std::max<int64_t>(Lp, 16)), den(nb_max);
  std::vector<float*> erow(nb_max), orow(nb_max);
  int64_t mstride = mask.size(2);
  pybind11::gil_scoped_release no_gil;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < KVh; ++kv) {
      const float* kk = kp + b * keys.stride(0) + kv * keys.stride(1);
      const float* vv = vp + b * vals.stride(0) + kv * vals.stride(1);
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int64_t nb = std::min(ROW_BLOCK, rows - r0);
        for (int64_t i = 0; i < nb; ++i) {  // row r: query head kv * G + r / S at position r % S
          int64_t r = r0 + i, g = r / S, s = r % S;
          const float* src = qp + ((b * S + s) * H + kv * G + g) * hd;
          for (int64_t d = 0; d < hd; ++d) qbuf[i * hd + d] = src[d] * (float)scale;
          erow[i] = sbuf.data() + i * Lp;
          orow[i] = op + (b * S + s) * H * hd + (kv * G + g) * hd;
        }
        for (int64_t j0 = 0; j0 < L; j0 += 16)  // 16 keys stay in cache across the rows
          for (int64_t i = 0; i < nb; ++i) score_keys(qbuf.data() + i * hd, kk, keys.stride(2), hd, j0, L, erow[i]);
        for (int64_t i = 0; i < nb; ++i) {  // the row's visible keys: maximum, exponentials, their sum
          const uint8_t* mr = mp + (b * S + (r0 + i) % S) * mstride;
          float* e = erow[i];
          float top = -INFINITY;
          for (int64_t j = 0; j < L; ++j)
            if (mr[j]) top = std::max(top, e[j]);
          V sum = vzero();
          for (int64_t j0 = 0; j0 < L; j0 += 16) {
            uint32_t seen = 0;
            for (int k = 0; k < 16 && j0 + k < L; ++k) seen |= mr[j0 + k] ? 1u << k : 0;
            V x = vloadn(e + j0, L - j0);
            V ex = vkeep(exp_le0(vsub(x, vset1(top))), seen);
            vstoren(e + j0, ex, L - j0);
            sum = vadd(sum, ex);
          }
          den[i] = top == -INFINITY ? 1.0f : lanes_sum(sum);  // a row that sees no key: zeros
        }
        switch (HV) {
          case 1: values_of<1>(erow.data(), vv, vals.stride(2), L, orow.data(), den.data(), nb); break;
          case 2: values_of<2>(erow.data(), vv, vals.stride(2), L, orow.data(), den.data(), nb); break;
          case 4: values_of<4>(erow.data(), vv, vals.stride(2), L, orow.data(), den.data(), nb); break;
          case 8: values_of<8>(erow.data(), vv, vals.stride(2), L, orow.data(), den.data(), nb); break;
        }
      }
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = ISA;
  m.def("pack", &pack);
  m.def("partials", &partials);
  m.def("dense", &dense);
  m.def("attend", &attend);
}
