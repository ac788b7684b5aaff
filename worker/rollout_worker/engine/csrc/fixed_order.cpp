// Fixed-order float32 products for the deterministic kernels (issue 19): each row-parallel chunk's partial
// product, every output one chain of fused multiply-adds over the chunk's inputs in order, from zero. A
// vector's 16 lanes are 16 outputs (no sum across lanes), so an output's bits do not depend on the number
// of tokens, on where a token or an output falls in a tile, or on the other chunks: batch- and
// TP-invariant by construction, on any AVX-512 CPU. Built on first use by rollout_worker.engine.native.
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>

constexpr int64_t LANES = 16, BLOCK = 64;  // outputs per vector, per packed block (4 vectors)

// out[t, o] for TT tokens and OB blocks of 64 outputs: each (t, o) one chain of fused multiply-adds over k
// in order, from zero (a lane per output: no reduction across lanes). Token rows past the edge repeat the
// last one (computed, not stored); outputs at or past O (the packed weight's zero padding) are not stored.
template <int TT, int OB>
static inline void tile(const float* const* xr, const float* const* wb, int64_t K, float* const* outr,
                        int64_t o0, int64_t O, int tt) {
  __m512 acc[TT][OB * 4];
  for (int i = 0; i < TT; ++i)
    for (int j = 0; j < OB * 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[OB * 4];
    for (int b = 0; b < OB; ++b)
      for (int v = 0; v < 4; ++v) wv[b * 4 + v] = _mm512_loadu_ps(wb[b] + k * BLOCK + v * LANES);
    for (int i = 0; i < TT; ++i) {
      __m512 xv = _mm512_set1_ps(xr[i][k]);
      for (int j = 0; j < OB * 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < tt; ++i)
    for (int j = 0; j < OB * 4; ++j) {
      int64_t o = o0 + j * LANES;
      if (o >= O) break;
      int64_t rest = O - o;
      __mmask16 m = rest >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << rest) - 1);
      _mm512_mask_storeu_ps(outr[i] + o, m, acc[i][j]);
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
  int64_t full = T / 4 * 4;
  pybind11::gil_scoped_release no_gil;
  for (int64_t c = 0; c < n; ++c) {
    const float* wc = wp + c * blocks * width * BLOCK;
    tiles<4, 1>(xp + c * width, x.stride(0), wc, width, blocks, op + c * T * O, O, 0, full);
    tiles<1, 4>(xp + c * width, x.stride(0), wc, width, blocks, op + c * T * O, O, full, T);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("partials", &partials);
}
