// Packed-weight matmul for XLA:CPU, called from JAX through the XLA FFI (jaxspec/models/cpu_kernel.py builds
// and registers it; jaxspec/models/quant.py `matmul` is its caller and `dequantize` its reference).
//
//   y[m, n] = sum_k x[m, k] * W[n, k],   W[n, k] = scale[n, k / g] * code(n, k) (+ offset[n, k / g])
//
// Why it exists: XLA:CPU cannot read packed weights at memory speed. Its fused loop over int8 codes with group
// scales is compute-bound (no faster than the float32 dot that reads 3.2x more bytes), and any nibble
// unpacking inside a fusion loses vectorisation. This kernel reads every code once per call, whatever the
// number of rows m (a decode step, a draft tree), dequantises one weight row at a time into an L1-resident
// float buffer and takes the m dot products against it, split over output rows on XLA's intra-op threads.
//
// Codes, per weight row of K inputs:
//   bits = 8: K int8 codes, one per byte.
//   bits = 4: K / 2 bytes; in each block of 32 inputs, byte j holds input j in its low nibble and input
//             j + 16 in its high nibble (GGUF's Q4_0 / Q4_1 order). Nibbles are unsigned [0, 15]:
//             W = scale * nibble + offset with an offset, else W = scale * (nibble - 8).
// Float arithmetic only (no activation quantisation): the result equals dequantise-then-matmul up to
// float32 summation order.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* x;        // [M, K]
  const uint8_t* codes;  // [N, K * bits / 8]
  const float* scale;    // [N, G]
  const float* offset;   // [N, G] or null
  float* y;              // [M, N]
  int64_t M, N, K, G, bits;
  int64_t per;  // blocks of 32 inputs per scale group: K / G / 32
};

// The 32 weights of block b of row n, before scale and offset, as two float vectors (inputs 0-15, 16-31).
#if defined(__AVX512F__)
inline void block_codes(const Problem& p, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  if (p.bits == 8) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.codes + n * p.K + b * 32));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1)));
  } else {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + n * (p.K / 2) + b * 16));
    const __m128i mask = _mm_set1_epi8(15);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(c, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), mask)));
  }
}
#endif

// One tile of the product: output rows [n0, n0 + NR) x input rows [m0, m0 + R), before the offset term.
// The R input rows share each conversion of the codes, the NR output rows share each load of x, and the
// NR * R accumulators are independent FMA chains.
#if defined(__AVX512F__)
template <int NR, int R>
void dot_tile(const Problem& p, int64_t n0, int64_t m0, float (&out)[NR][R]) {
  __m512 acc[NR][R];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < p.G; ++j) {
    __m512 sj[NR];
    for (int r = 0; r < NR; ++r) sj[r] = _mm512_set1_ps(p.scale[(n0 + r) * p.G + j]);
    for (int64_t b = j * p.per, end = b + p.per; b < end; ++b) {
      __m512 xlo[R], xhi[R];
      for (int i = 0; i < R; ++i) {
        xlo[i] = _mm512_loadu_ps(p.x + (m0 + i) * p.K + b * 32);
        xhi[i] = _mm512_loadu_ps(p.x + (m0 + i) * p.K + b * 32 + 16);
      }
      for (int r = 0; r < NR; ++r) {
        __m512 lo, hi;
        block_codes(p, n0 + r, b, lo, hi);
        for (int i = 0; i < R; ++i)
          acc[r][i] = _mm512_fmadd_ps(sj[r], _mm512_fmadd_ps(xhi[i], hi, _mm512_mul_ps(xlo[i], lo)), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}
#else
// Portable fallback (no AVX-512): the same sums, one weight at a time.
template <int NR, int R>
void dot_tile(const Problem& p, int64_t n0, int64_t m0, float (&out)[NR][R]) {
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) {
      const int64_t n = n0 + r;
      const float* xm = p.x + (m0 + i) * p.K;
      float total = 0.0f;
      for (int64_t b = 0; b < p.K / 32; ++b) {
        float t = 0.0f;
        for (int64_t k = 0; k < 32; ++k) {
          const float c = p.bits == 8
                              ? static_cast<float>(reinterpret_cast<const int8_t*>(p.codes)[n * p.K + b * 32 + k])
                              : static_cast<float>((p.codes[n * (p.K / 2) + b * 16 + k % 16] >> (k / 16 * 4)) & 15);
          t += xm[b * 32 + k] * c;
        }
        total += p.scale[n * p.G + b / p.per] * t;
      }
      out[r][i] = total;
    }
}
#endif

// Tile plus the offset term (sum_k x[k] * offset[g] = offset[g] * xsum[g], xsum [M, G] the input rows' group
// sums), stored into y.
template <int NR, int R>
void tile(const Problem& p, const float* xsum, int64_t n0, int64_t m0) {
  float out[NR][R];
  dot_tile<NR, R>(p, n0, m0, out);
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) {
      float off = 0.0f;
      const float* xs = xsum + (m0 + i) * p.G;
      if (p.offset) {
        const float* o = p.offset + (n0 + r) * p.G;
#pragma omp simd reduction(+ : off)
        for (int64_t j = 0; j < p.G; ++j) off += o[j] * xs[j];
      } else if (p.bits == 4) {  // symmetric 4-bit: code = nibble - 8
        const float* s = p.scale + (n0 + r) * p.G;
#pragma omp simd reduction(+ : off)
        for (int64_t j = 0; j < p.G; ++j) off -= 8.0f * s[j] * xs[j];
      }
      p.y[(m0 + i) * p.N + n0 + r] = out[r][i] + off;
    }
}

// Output rows [n0, n1) for all M input rows: tiles of 4 output rows for a single input row (decode), else
// 2 output rows x up to 4 input rows.
void run_rows(const Problem& p, const float* xsum, int64_t n0, int64_t n1) {
  if (p.M == 1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile<4, 1>(p, xsum, n, 0);
    for (; n < n1; ++n) tile<1, 1>(p, xsum, n, 0);
    return;
  }
  for (int64_t m = 0; m < p.M; m += 4) {
    const int64_t r = std::min<int64_t>(4, p.M - m);
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) switch (r) {
        case 1: tile<2, 1>(p, xsum, n, m); break;
        case 2: tile<2, 2>(p, xsum, n, m); break;
        case 3: tile<2, 3>(p, xsum, n, m); break;
        default: tile<2, 4>(p, xsum, n, m);
      }
    for (; n < n1; ++n) switch (r) {
        case 1: tile<1, 1>(p, xsum, n, m); break;
        case 2: tile<1, 2>(p, xsum, n, m); break;
        case 3: tile<1, 3>(p, xsum, n, m); break;
        default: tile<1, 4>(p, xsum, n, m);
      }
  }
}

// Work shared between the calling thread and pool tasks: chunks of output rows handed out by an atomic
// counter. The caller takes chunks too and waits only for chunks already being worked on, so it never waits
// on a task that has not started (no deadlock when the pool is busy); late tasks find nothing left and exit.
struct Shared {
  Problem p;
  std::vector<float> xsum;  // [M, G]
  int64_t chunk, n_chunks;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < n_chunks;) {
      run_rows(p, xsum.data(), i * chunk, std::min(p.N, (i + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                        int64_t bits, bool with_offset) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || (bits != 8 && bits != 4))
    return ffi::Error::InvalidArgument("packed_matmul: expects x [M, K], codes [N, K*bits/8], scale [N, G]");
  Problem p{x.typed_data(), codes.typed_data(), scale.typed_data(),
            with_offset ? offset.typed_data() : nullptr, y->typed_data(),
            xd[0], cd[0], xd[1], sd[1], bits, 0};
  if (cd[1] * 8 != p.K * bits || sd[0] != p.N || p.G <= 0 || p.K % p.G || (p.K / p.G) % 32)
    return ffi::Error::InvalidArgument("packed_matmul: codes / scale shapes do not match x (groups of 32k inputs)");
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  p.per = p.K / p.G / 32;
  auto sh = std::make_shared<Shared>();
  sh->p = p;
  if (p.offset || p.bits == 4) {
    const int64_t g = p.K / p.G;
    sh->xsum.assign(p.M * p.G, 0.0f);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < p.K; ++k) sh->xsum[m * p.G + k / g] += p.x[m * p.K + k];
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || p.N * p.K * (p.M + 1) < (int64_t{1} << 18)) {  // too small to be worth waking a thread
    run_rows(p, sh->xsum.data(), 0, p.N);
    return ffi::Error::Success();
  }
  sh->chunk = std::max<int64_t>(8, (p.N + 4 * threads - 1) / (4 * threads));
  sh->n_chunks = (p.N + sh->chunk - 1) / sh->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < sh->n_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("with_offset"));
