// Matmuls for XLA:CPU with few input rows, called from JAX through the XLA FFI (jaxspec/kernels/cpu.py, the CPU
// backend, builds and registers them). Two kernels: the packed-weight product below (caller cpu.packed_matmul,
// reference jaxspec/kernels/xla.py's `packed_matmul` over `dequantize`), and the float32 product further down
// (`Dense`; caller cpu.dense, reference XLA's dot; `DenseMany` runs it for several weights that share one
// input). After them, two companions of a decode or verify forward: a row-wise argmax and the attention of a
// few new tokens over a KV cache (`CacheAttention`).
//
// Packed weights:
//   y[m, n] = sum_k x[m, k] * W[n, k],   W[n, k] = scale[n, k / g] * code(n, k) (+ offset[n, k / g])
//
// Why it exists: a decode step is bound by the weight bytes it reads, and XLA:CPU has no product that reads
// packed weights at memory speed (its fused loop over int8 codes is compute-bound; nibble unpacking inside a
// fusion loses vectorisation). This kernel reads every code once per call, whatever the number of rows m (a
// decode step, a draft tree), split over output rows on XLA's intra-op threads.
//
// Codes, per weight row of K inputs (K a multiple of 32, g a multiple of 32):
//   bits = 8: K int8 codes, one per byte.
//   bits = 4: K / 2 bytes; in each block of 32 inputs, byte j holds input j in its low nibble and input
//             j + 16 in its high nibble (GGUF's Q4_0 / Q4_1 order). Nibbles are unsigned [0, 15]:
//             W = scale * nibble + offset with an offset, else W = scale * (nibble - 8).
//
// Two paths, both within float32 rounding of dequantise-then-matmul (tests/test_quant.py):
//   * integer (AVX-512 VNNI; g = 32 as in every GGUF / on-the-fly int4 / compressed-tensors layout, or g a
//     multiple of the 64-byte slice, e.g. one scale per output channel): x is split into three int8 limbs per
//     block and the block products are exact integer dot products (see Prepared);
//   * float (other g, or no VNNI): codes converted to float and multiply-added.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

// The kernels are written for AVX-512 (x86-64: Intel Xeon since Skylake-SP, AMD since Zen 4). With AVX2 and FMA
// only (most desktop CPUs) the library holds the products of weights in column tiles alone (`kt_rows`, 8 lanes);
// with neither, none. `jaxspec_vectorised` says which, and jaxspec/kernels/cpu.py runs XLA's forms for the rest:
// plain loops in the kernels' place made AR decode several times slower than XLA's forms (this file built with
// -march=haswell; docs/benchmarks/cpu.md, "Which CPUs run jaxspec's kernels").
extern "C" int jaxspec_vectorised() {  // 2: every kernel; 1: column tiles only; 0: none
#if defined(__AVX512F__)
  return 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#if defined(__AVX512F__)
#define JAXSPEC_AVX512 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAXSPEC_VNNI 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Work shared between the calling thread and pool tasks: chunks of output columns handed out by an atomic
// counter. The caller takes chunks too and waits only for chunks already being worked on, so it never waits
// on a task that has not started (no deadlock when the pool is busy); late tasks find nothing left and exit.
struct Shared {
  std::function<void(int64_t, int64_t)> rows;  // computes outputs [n0, n1) for every input row
  int64_t N = 0, chunk = 0, n_chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < n_chunks;) {
      rows(i * chunk, std::min(N, (i + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Outputs [0, N) in about `per_thread` chunks per thread (a multiple of `align` outputs each, at least `least`),
// over the pool's threads when the work (weights read times input rows + 1) is worth waking them for.
void parallel(ffi::ThreadPool& pool, int64_t N, int64_t align, int64_t per_thread, int64_t work,
              std::function<void(int64_t, int64_t)> rows, int64_t least = 8) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || work < (int64_t{1} << 18)) {
    rows(0, N);
    return;
  }
  auto sh = std::make_shared<Shared>();
  sh->rows = std::move(rows);
  sh->N = N;
  const int64_t want = std::max<int64_t>(least, (N + per_thread * threads - 1) / (per_thread * threads));
  sh->chunk = (want + align - 1) / align * align;
  sh->n_chunks = (N + sh->chunk - 1) / sh->chunk;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < sh->n_chunks) std::this_thread::yield();
}

#if defined(JAXSPEC_AVX512)
struct Problem {
  const float* x;        // [M, K]
  const uint8_t* codes;  // [N, K * bits / 8]
  const float* scale;    // [N, G]
  const float* offset;   // [N, G] or null
  float* y;              // [M, N]
  int64_t M, N, K, G;
  int64_t per;  // blocks of 32 inputs per scale group: K / G / 32
};

// What one call derives from x before touching the weights (a few bytes per input, built by the caller).
//
// Integer path: each 32-input block of x is split into three int8 limbs, x = sx (a0 + a1 / 254 + a2 / 254^2),
// sx = max|x| / 127, |a_t| <= 127: the error is at most sx / 2 / 254^2 = 6e-8 max|x|, below float32's own
// rounding of x. A block's products are then integer dot products (`vpdpbusd`, 64 code bytes x 64 limb bytes
// per instruction, exact in int32), three per 64 code bytes instead of a conversion and a multiply-add per
// weight. Codes are read one 64-byte slice of a weight row at a time: 4-bit, 4 blocks (128 inputs); 8-bit,
// 2 blocks (64 inputs). Int32 lane l of a slice covers its bytes 4l .. 4l + 3, so a block owns 4 (4-bit) or
// 8 (8-bit) lanes, and per-block factors are laid out per lane.
struct Prepared {
  std::vector<float> xsum;   // float path, [M, G]: each input row's sum over each group
  bool integer = false;
  int64_t slices = 0;        // 64-byte slices per weight row
  std::vector<int8_t> a;     // [M, slices, 3, 128 (4-bit: the 64 low-nibble inputs, then the 64 high) | 64]
  std::vector<int32_t> init; // [M, slices, 3, 16] 8-bit: codes are read as unsigned c + 128, so each lane
                             //   starts at -128 x the sum of its limb bytes
  std::vector<float> sx;     // [M, slices, 3, 16] the lane's block scale of x times 254^-t
  std::vector<float> xs;     // [M, slices, 16] the lane's share of its block's sum of x (times -8 when 4-bit
                             //   codes are symmetric: W = scale (nibble - 8))
};

#if defined(JAXSPEC_VNNI)
constexpr float kLimbWeight[3] = {1.0f, 1.0f / 254.0f, 1.0f / (254.0f * 254.0f)};

template <int BITS>
void prepare_integer(const Problem& p, Prepared& q) {
  constexpr int64_t bpc = BITS == 4 ? 4 : 2, lanes = 16 / bpc, abytes = BITS == 4 ? 128 : 64;
  const int64_t nb = p.K / 32, S = (nb + bpc - 1) / bpc;
  q.integer = true;
  q.slices = S;
  q.a.assign(p.M * S * 3 * abytes, 0);
  q.init.assign(p.M * S * 3 * 16, 0);
  q.sx.assign(p.M * S * 3 * 16, 0.0f);
  q.xs.assign(p.M * S * 16, 0.0f);
  const float sum_factor = (p.offset ? 1.0f : BITS == 4 ? -8.0f : 0.0f) / lanes;
  const __m512 lim = _mm512_set1_ps(127.0f), base254 = _mm512_set1_ps(254.0f);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = p.x + m * p.K + b * 32;
      __m512 r[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};  // inputs 0-15, 16-31
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(r[0]), _mm512_abs_ps(r[1])));
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(r[0], r[1]));
      const float sxb = mx / 127.0f;
      const int64_t c = b / bpc, j = b % bpc, base = m * S + c;
      for (int h = 0; h < 2; ++h)
        r[h] = sxb > 0.0f ? _mm512_div_ps(r[h], _mm512_set1_ps(sxb)) : _mm512_setzero_ps();
      for (int t = 0; t < 3; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m512 a = _mm512_min_ps(lim, _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim),
              _mm512_roundscale_ps(r[h], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          // 4-bit: inputs 0-15 of block j go to bytes 16 j .. of the low half, 16-31 to the high half
          int8_t* dst = q.a.data() + (base * 3 + t) * abytes + (BITS == 4 ? h * 64 + 16 * j : 32 * j + 16 * h);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
          r[h] = _mm512_mul_ps(_mm512_sub_ps(r[h], a), base254);
        }
      for (int64_t l = j * lanes; l < (j + 1) * lanes; ++l) {
        for (int t = 0; t < 3; ++t) q.sx[(base * 3 + t) * 16 + l] = sxb * kLimbWeight[t];
        q.xs[base * 16 + l] = sum * sum_factor;
      }
    }
  if (BITS == 8) {  // each lane starts at -128 x the sum of its 4 limb bytes
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t i = 0; i < p.M * S * 3; ++i) {
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(q.a.data() + i * abytes));
      _mm512_storeu_si512(q.init.data() + i * 16, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
    }
  }
}
#endif

void prepare_float(const Problem& p, Prepared& q) {
  const int64_t g = p.K / p.G;
  q.xsum.assign(p.M * p.G, 0.0f);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) q.xsum[m * p.G + k / g] += p.x[m * p.K + k];
}

#if defined(JAXSPEC_VNNI)
// Integer path: output rows [n0, n0 + NR) x input rows [m0, m0 + R) -> out. Scales: one per block (per = 1)
// or groups of whole slices.
template <int BITS, bool OFFSET, int NR, int R>
void integer_tile(const Problem& p, const Prepared& q, int64_t n0, int64_t m0, float (&out)[NR][R]) {
  constexpr int64_t bpc = BITS == 4 ? 4 : 2, abytes = BITS == 4 ? 128 : 64;
  const int64_t nb = p.K / 32, row_bytes = p.K * BITS / 8, S = q.slices;
  const __m512i block_of_lane =
      _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), BITS == 4 ? 2 : 3);
  const __m512i low4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NR][R];
#pragma GCC unroll 16
  for (int r = 0; r < NR * R; ++r) acc[r / R][r % R] = _mm512_setzero_ps();
  for (int64_t c = 0; c < S; ++c) {
    const int64_t valid = std::min(bpc, nb - c * bpc);  // blocks in this slice (the last one may be partial)
    const __mmask64 cm = valid == bpc ? ~__mmask64{0} : (__mmask64{1} << (valid * 4 * BITS)) - 1;
    const __mmask16 sm = static_cast<__mmask16>((1u << valid) - 1);
    __m512i lo[NR], hi[NR];
    __m512 sw[NR], ow[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const int64_t n = n0 + r;
      // The rows two tiles ahead (past the end only in the last tiles: a prefetch never faults).
      _mm_prefetch(reinterpret_cast<const char*>(p.codes + (n + 2 * NR) * row_bytes + c * 64), _MM_HINT_T0);
      if ((c & 3) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(p.scale + (n + 2 * NR) * p.G + c * bpc), _MM_HINT_T0);
        if (OFFSET) _mm_prefetch(reinterpret_cast<const char*>(p.offset + (n + 2 * NR) * p.G + c * bpc), _MM_HINT_T0);
      }
      const __m512i v = _mm512_maskz_loadu_epi8(cm, p.codes + n * row_bytes + c * 64);
      if (BITS == 4) {
        lo[r] = _mm512_and_si512(v, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else {
        lo[r] = _mm512_xor_si512(v, top);  // c + 128, unsigned
      }
      if (p.per == 1) {  // a scale per block: lane l takes its block's
        sw[r] = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(sm, p.scale + n * p.G + c * bpc));
        if (OFFSET)
          ow[r] = _mm512_permutexvar_ps(block_of_lane, _mm512_maskz_loadu_ps(sm, p.offset + n * p.G + c * bpc));
      } else {  // the slice lies in one group
        sw[r] = _mm512_set1_ps(p.scale[n * p.G + c * bpc / p.per]);
        if (OFFSET) ow[r] = _mm512_set1_ps(p.offset[n * p.G + c * bpc / p.per]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const int64_t base = (m0 + i) * S + c;
      const int8_t* a = q.a.data() + base * 3 * abytes;
      const float* sx = q.sx.data() + base * 3 * 16;
      const __m512 xs = _mm512_loadu_ps(q.xs.data() + base * 16);
      __m512i at[3][BITS == 4 ? 2 : 1], d0[3];
#pragma GCC unroll 3
      for (int t = 0; t < 3; ++t) {
        at[t][0] = _mm512_loadu_si512(a + t * abytes);
        if (BITS == 4) at[t][BITS == 4 ? 1 : 0] = _mm512_loadu_si512(a + t * abytes + 64);
        d0[t] = BITS == 8 ? _mm512_loadu_si512(q.init.data() + (base * 3 + t) * 16) : _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        __m512 f = _mm512_setzero_ps();
#pragma GCC unroll 3
        for (int t = 0; t < 3; ++t) {
          __m512i d = _mm512_dpbusd_epi32(d0[t], lo[r], at[t][0]);
          if (BITS == 4) d = _mm512_dpbusd_epi32(d, hi[r], at[t][BITS == 4 ? 1 : 0]);
          f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(sx + t * 16), f);
        }
        if (OFFSET)
          acc[r][i] = _mm512_fmadd_ps(ow[r], xs, _mm512_fmadd_ps(sw[r], f, acc[r][i]));
        else if (BITS == 4)
          acc[r][i] = _mm512_fmadd_ps(sw[r], _mm512_add_ps(f, xs), acc[r][i]);
        else
          acc[r][i] = _mm512_fmadd_ps(sw[r], f, acc[r][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR * R; ++r) out[r / R][r % R] = _mm512_reduce_add_ps(acc[r / R][r % R]);
}
#endif

// Float path, before the offset term: the 32 codes of block b of row n as two float vectors (inputs 0-15,
// 16-31), scaled per group and multiply-added. The R input rows share each conversion of the codes, the NR
// output rows each load of x.
template <int BITS>
inline void block_codes(const Problem& p, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  if (BITS == 8) {
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

template <int BITS, int NR, int R>
void float_tile(const Problem& p, int64_t n0, int64_t m0, float (&out)[NR][R]) {
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
        block_codes<BITS>(p, n0 + r, b, lo, hi);
        for (int i = 0; i < R; ++i)
          acc[r][i] = _mm512_fmadd_ps(sj[r], _mm512_fmadd_ps(xhi[i], hi, _mm512_mul_ps(xlo[i], lo)), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) out[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

// One tile stored into y: the integer path where prepared, else the float path plus the offset term
// (sum_k x[k] * offset[g] = offset[g] * xsum[g]; symmetric 4-bit: offset = -8 scale).
template <int BITS, bool OFFSET, int NR, int R>
void tile(const Problem& p, const Prepared& q, int64_t n0, int64_t m0) {
  float out[NR][R];
#if defined(JAXSPEC_VNNI)
  if (q.integer) {
    integer_tile<BITS, OFFSET, NR, R>(p, q, n0, m0, out);
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < R; ++i) p.y[(m0 + i) * p.N + n0 + r] = out[r][i];
    return;
  }
#endif
  float_tile<BITS, NR, R>(p, n0, m0, out);
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < R; ++i) {
      float off = 0.0f;
      const float* xs = q.xsum.data() + (m0 + i) * p.G;
      const float* o = OFFSET ? p.offset + (n0 + r) * p.G : p.scale + (n0 + r) * p.G;
      const float f = OFFSET ? 1.0f : BITS == 4 ? -8.0f : 0.0f;
#pragma omp simd reduction(+ : off)
      for (int64_t j = 0; j < p.G; ++j) off += o[j] * xs[j];
      p.y[(m0 + i) * p.N + n0 + r] = out[r][i] + f * off;
    }
}

// Output rows [n0, n1) for all M input rows: tiles of 4 output rows for one input row (decode), else 2 output
// rows x up to 4 input rows.
template <int BITS, bool OFFSET>
void run_rows(const Problem& p, const Prepared& q, int64_t n0, int64_t n1) {
  if (p.M == 1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile<BITS, OFFSET, 4, 1>(p, q, n, 0);
    for (; n < n1; ++n) tile<BITS, OFFSET, 1, 1>(p, q, n, 0);
    return;
  }
  for (int64_t m = 0; m < p.M; m += 4) {
    const int64_t r = std::min<int64_t>(4, p.M - m);
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) switch (r) {
        case 1: tile<BITS, OFFSET, 2, 1>(p, q, n, m); break;
        case 2: tile<BITS, OFFSET, 2, 2>(p, q, n, m); break;
        case 3: tile<BITS, OFFSET, 2, 3>(p, q, n, m); break;
        default: tile<BITS, OFFSET, 2, 4>(p, q, n, m);
      }
    for (; n < n1; ++n) switch (r) {
        case 1: tile<BITS, OFFSET, 1, 1>(p, q, n, m); break;
        case 2: tile<BITS, OFFSET, 1, 2>(p, q, n, m); break;
        case 3: tile<BITS, OFFSET, 1, 3>(p, q, n, m); break;
        default: tile<BITS, OFFSET, 1, 4>(p, q, n, m);
      }
  }
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                        int64_t bits, bool with_offset) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  const auto want = bits == 4 ? ffi::DataType::U8 : ffi::DataType::S8;
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || (bits != 8 && bits != 4) || codes.element_type() != want)
    return ffi::Error::InvalidArgument("packed_matmul: expects x [M, K], codes [N, K] int8 or [N, K / 2] uint8, scale [N, G]");
  Problem p{x.typed_data(), static_cast<const uint8_t*>(codes.untyped_data()), scale.typed_data(),
            with_offset ? offset.typed_data() : nullptr, y->typed_data(), xd[0], cd[0], xd[1], sd[1], 0};
  if (cd[1] * 8 != p.K * bits || sd[0] != p.N || p.G <= 0 || p.K % p.G || (p.K / p.G) % 32)
    return ffi::Error::InvalidArgument("packed_matmul: codes / scale shapes do not match x (groups of 32k inputs)");
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  p.per = p.K / p.G / 32;
  auto q = std::make_shared<Prepared>();
#if defined(JAXSPEC_VNNI)
  if (p.per == 1 || p.per % (bits == 4 ? 4 : 2) == 0)  // one scale per block, or per whole slice
    bits == 4 ? prepare_integer<4>(p, *q) : prepare_integer<8>(p, *q);
#endif
  if (!q->integer) prepare_float(p, *q);
  auto rows = bits == 4 ? (with_offset ? run_rows<4, true> : run_rows<4, false>)
                        : (with_offset ? run_rows<8, true> : run_rows<8, false>);
  parallel(pool, p.N, 1, 4, p.N * p.K * (p.M + 1),
           [p, q, rows](int64_t n0, int64_t n1) { rows(p, *q, n0, n1); });
  return ffi::Error::Success();
}

#endif  // JAXSPEC_AVX512 (packed weights)

// Float32 products with few input rows: y[M, N] = x[M, K] @ W, W stored [K, N] (a Linear's kernel), in column
// tiles [T, K, 48] (a Linear's kernel as `jaxspec.load` keeps it on a CPU: cpu.tile; float32 or
// bfloat16) or [N, K] (a tied embedding used as the LM head). XLA:CPU's product reads W once for one row (a
// matrix-vector product) but, for 2 to a few dozen rows, packs W into its GEMM layout on every call, so a 2-row
// product costs two 1-row ones and a 5-node tree verify twice a decode step. These tiles read W once for all rows.
struct Dense {
  const float* x;      // [M, K]
  const float* w;      // [K, N], or [V, K] when nk
  const int32_t* idx;  // nk: output n uses W's row idx[n] (a draft vocabulary's rows, no gathered copy), or null
  float* y;            // [M, N]
  int64_t M, N, K, V;  // V: W's rows (nk)
  const uint16_t* wh = nullptr;  // column tiles in bfloat16 instead of w (see kt_tile)
  // Row n of W [V, K]; an index outside [0, V) is clamped (never a read outside W).
  const float* row(int64_t n) const { return w + (idx ? std::clamp<int64_t>(idx[n], 0, V - 1) : n) * K; }
};

constexpr int64_t kTile = 48;  // columns of a column tile (cpu.TILE in jaxspec/kernels/cpu.py)

#if defined(JAXSPEC_AVX512)
// W [K, N]: outputs [j0, j0 + 64) x input rows [m0, m0 + R) over the block of inputs [k0, k0 + KB), sums in
// registers (y holds the running sum between blocks). While a block is multiplied, the same tile of the next block is
// prefetched into L2, so W's strided tile reads never wait on memory. This timed faster than reading W's rows
// contiguously with the sums in L1, the more so the more rows (bench/cpu/cpu_matmul.py times these products).
constexpr int64_t kKB = 32;

template <int R>
void kn_tile(const Dense& p, int64_t k0, int64_t j0, int64_t m0) {
  constexpr int C = 4;
  __mmask16 mask[C];
  for (int c = 0; c < C; ++c)
    mask[c] = static_cast<__mmask16>((1u << std::clamp<int64_t>(p.N - j0 - 16 * c, 0, 16)) - 1);
  float* y = p.y + m0 * p.N + j0;
  __m512 acc[R][C];
#pragma GCC unroll 24
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  const float* w = p.w + k0 * p.N + j0;
  const float* x = p.x + m0 * p.K + k0;
  const int64_t kend = std::min<int64_t>(kKB, p.K - k0);
  const bool next = k0 + kKB < p.K;
  for (int64_t k = 0; k < kend; ++k, w += p.N) {
    if (next && k0 + kKB + k < p.K)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + kKB * p.N + 16 * c), _MM_HINT_T1);
    __m512 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = _mm512_maskz_loadu_ps(mask[c], w + 16 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * p.K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * C; ++i) {  // the block's sum joins the running sum (blocked: rounding ~ K / 32 + 32)
    float* yi = y + (i / C) * p.N + 16 * (i % C);
    const __m512 prev = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[i % C], yi);
    _mm512_mask_storeu_ps(yi, mask[i % C], _mm512_add_ps(prev, acc[i / C][i % C]));
  }
}

// n0: a multiple of 64. Input rows go in groups of at most 6, as even as their count allows (11 rows: 6 + 5, not
// 5 + 5 + 1, whose last group pays a whole pass over the tile's weights for 4 multiply-adds per load).
void kn_rows(const Dense& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.M + 5) / 6;
  for (int64_t k0 = 0; k0 < p.K; k0 += kKB)
    for (int64_t j = n0; j < n1; j += 64)
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t r = (p.M - m + groups - g - 1) / (groups - g);
        switch (r) {
          case 1: kn_tile<1>(p, k0, j, m); break;
          case 2: kn_tile<2>(p, k0, j, m); break;
          case 3: kn_tile<3>(p, k0, j, m); break;
          case 4: kn_tile<4>(p, k0, j, m); break;
          case 5: kn_tile<5>(p, k0, j, m); break;
          default: kn_tile<6>(p, k0, j, m);
        }
        m += r;
      }
}

// W in column tiles [T, K, 48] (tile t holds W[:, 48 t : 48 t + 48], zeros past N): outputs [j0, j0 + 48) x
// input rows [m0, m0 + R), each sum over all of K in a register. A tile is one contiguous stream of K x 192
// bytes, which the core reads at memory speed, where a [K, N] tile is K pieces a row apart. Three columns of
// vectors leave registers for up to 9 rows (27 sums), so a 9-node verify reads each weight once, and at the
// same speed as a decode step, and faster than kn_rows on [K, N] for a decode step and a verify alike
// (bench/cpu/cpu_matmul.py times both; bench/cpu/tiles.py what the tiles buy in decoding).

// Tiles may hold bfloat16 (`wh`): the weights of a bfloat16 checkpoint, kept so when every value is one
// (cpu.tile). Widening a bfloat16 to float32 is exact (its 16 bits become the high half), so the sums are
// the float32 tiles' own, bit for bit, from half the bytes.
template <bool BF16>
inline __m512 tile_vector(const Dense& p, int64_t at) {
  if constexpr (BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.wh + at))), 16));
  else
    return _mm512_loadu_ps(p.w + at);
}

template <int R, bool BF16>
void kt_tile(const Dense& p, int64_t j0, int64_t m0, int64_t g, int64_t G, bool ahead) {
  constexpr int C = kTile / 16;
  constexpr int64_t bytes = BF16 ? 2 : 4;
  __m512 acc[R][C];
#pragma GCC unroll 27
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm512_setzero_ps();
  int64_t at = (j0 / kTile) * p.K * kTile;  // element offset of the tile's row k
  const char* base = BF16 ? reinterpret_cast<const char*>(p.wh) : reinterpret_cast<const char*>(p.w);
  // G > 0: this is group g of G, each reading the whole tile; it prefetches the g-th share of the next tile into L2
  // (see kt_rows).
  const int64_t lo = G > 0 ? p.K * g / G : 0, share = G > 0 ? p.K * (g + 1) / G - lo : 0;
  const char* next = base + (at + p.K * kTile + lo * kTile) * bytes;
  const float* x = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k, at += kTile) {
    if (ahead)
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c)  // 32 rows of the tile ahead (past its end: the next tile's, or unmapped,
        _mm_prefetch(base + (at + 32 * kTile + 16 * c) * bytes, _MM_HINT_T0);  // which never faults)
    if (G > 0)
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c)
        _mm_prefetch(next + (share * k / p.K * kTile + 16 * c) * bytes, _MM_HINT_T1);
    __m512 wv[C];
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) wv[c] = tile_vector<BF16>(p, at + 16 * c);
#pragma GCC unroll 9
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * p.K + k]);
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wv[c], acc[r][c]);
    }
  }
  float* y = p.y + m0 * p.N + j0;
#pragma GCC unroll 27
  for (int i = 0; i < R * C; ++i) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::clamp<int64_t>(p.N - j0 - 16 * (i % C), 0, 16)) - 1);
    _mm512_mask_storeu_ps(y + (i / C) * p.N + 16 * (i % C), mask, acc[i / C][i % C]);
  }
}

template <int R = 9>  // kt_tile<r> for 1 <= r <= 9 input rows
void kt_tile_rows(const Dense& p, int64_t j0, int64_t m0, int64_t r, int64_t g, int64_t G, bool ahead) {
  if constexpr (R > 1)
    if (r < R) return kt_tile_rows<R - 1>(p, j0, m0, r, g, G, ahead);
  p.wh ? kt_tile<R, true>(p, j0, m0, g, G, ahead) : kt_tile<R, false>(p, j0, m0, g, G, ahead);
}

// n0: a multiple of kTile. Input rows go in groups of at most 9, as even as their count allows, each group reading
// the whole tile. One group prefetches ahead in its own tile. With several, later groups reread the tile from L2
// while memory would stand idle, so where a tile fits in L2 beside the next one (kStreamTile), each group
// prefetches its share of the next tile instead (the last tile's: the first of the range after it, another
// thread's or the next weight's) and only the first tile's first group prefetches in its own (nothing fetched
// that tile before). A 4-row verify at budget 2 (12 rows, two groups) gains most
// (docs/benchmarks/cpu.md, "The next tile streams while later row groups compute").
constexpr int64_t kStreamTile = 384 << 10;  // bytes: two tiles in a 1 MB L2 (Zen 4, Skylake-SP; more elsewhere)

void kt_rows(const Dense& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.M + 8) / 9;
  const bool stream = groups > 1 && p.K * kTile * (p.wh ? 2 : 4) <= kStreamTile;
  for (int64_t j = n0; j < n1; j += kTile)
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t r = (p.M - m + groups - g - 1) / (groups - g);
      kt_tile_rows(p, j, m, r, g, stream ? groups : 0, !stream || (j == n0 && g == 0));
      m += r;
    }
}

// W [N, K]: outputs [n0, n0 + NR) x input rows [m0, m0 + R), dot products over k, 16 inputs at a time. Row
// pointers and sizes are read into locals first and the closing sums are unrolled: otherwise the compiler,
// unsure that the stores do not alias `p`, keeps the sums in memory and reloads p's fields in the inner loop
// (measurably slower). The rows two tiles on are prefetched, spread over the tile's G row groups (group g
// fetches the g-th share of their inputs), so memory keeps streaming while later groups reread this tile from
// L1 (SmolLM2's head at 9 rows inside a round ran faster this way than with every prefetch in the first group).
template <int NR, int R>
void nk_tile(const Dense& p, int64_t n0, int64_t m0, int64_t g, int64_t G) {
  const int64_t K = p.K, N = p.N, lo = K * g / G, share = K * (g + 1) / G - lo;
  const float *wr[NR], *ahead[NR], *xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    wr[r] = p.row(n0 + r);
    ahead[r] = n0 + r + 2 * NR < N ? p.row(n0 + r + 2 * NR) : wr[r];  // the rows two tiles on
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xr[i] = p.x + (m0 + i) * K;
  __m512 acc[NR][R];
#pragma GCC unroll 32
  for (int i = 0; i < NR * R; ++i) acc[i / R][i % R] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, K - k)) - 1);
    __m512 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead[r] + lo + share * k / K), _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_ps(m, wr[r] + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, xr[i] + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  float* y = p.y;
#pragma GCC unroll 32
  for (int j = 0; j < NR * R; ++j) y[(m0 + j % R) * N + n0 + j / R] = _mm512_reduce_add_ps(acc[j / R][j % R]);
}

template <int NR, int R = 6>  // nk_tile<NR, r> for 1 <= r <= 6 input rows
void nk_tile_rows(const Dense& p, int64_t n0, int64_t m0, int64_t r, int64_t g, int64_t G) {
  if constexpr (R > 1)
    if (r < R) return nk_tile_rows<NR, R - 1>(p, n0, m0, r, g, G);
  nk_tile<NR, R>(p, n0, m0, g, G);
}

// One input row over all of W [V, K] (a decode step's tied LM head): W's rows in storage order, so one stream
// prefetched 4 KB ahead, each dot product in 4 independent sums.
inline void nk_one(const Dense& p, int64_t n) {
  const int64_t K = p.K;
  const float* w = p.row(n);
  const float* x = p.x;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k + 1024), _MM_HINT_T0);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k < K; k += 16) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, K - k)) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), a0);
  }
  p.y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// Tiles of 4 outputs x up to 6 input rows (24 sums in registers), the rows split evenly (13 = 4 + 4 + 5, not
// 6 + 6 + 1): later groups reread the tile's 4 weight rows from L1. One input row over all of W reads it as one
// stream (`nk_one`): for SmolLM2's tied [49152, 576] head at 1 row, one stream beat tiles of 4 and of 8
// outputs (docs/benchmarks/cpu.md, "The three cuts"). Gathered rows (a draft vocabulary) are no stream and
// keep the tiles: 8 outputs a tile were no faster there.
void nk_rows(const Dense& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.M + 5) / 6;
  if (p.M == 1 && !p.idx) {
    for (int64_t n = n0; n < n1; ++n) nk_one(p, n);
    return;
  }
  for (int64_t n = n0; n < n1;) {
    const bool four = n + 4 <= n1;
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t r = (p.M - m) / (groups - g);
      four ? nk_tile_rows<4>(p, n, m, r, g, groups) : nk_tile_rows<1>(p, n, m, r, g, groups);
      m += r;
    }
    n += four ? 4 : 1;
  }
}

#else
// AVX2 (16 vector registers of 8 lanes): one input row takes a whole tile row (6 vectors) at a time; more rows
// go 3 at a time over half a tile row (9 sums, 3 broadcasts, 1 weight vector), reading the tile again per
// group, from L2 after the first pass.
template <bool BF16>
inline __m256 tile_vector(const Dense& p, int64_t at) {
  if constexpr (BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.wh + at))), 16));
  else
    return _mm256_loadu_ps(p.w + at);
}

// Outputs [j0, j0 + 8 C) (c0: the first of the tile's 6 vectors) x input rows [m0, m0 + R).
template <int C, int R, bool BF16>
void kt_part(const Dense& p, int64_t j0, int c0, int64_t m0) {
  constexpr int64_t bytes = BF16 ? 2 : 4;
  __m256 acc[R][C];
  for (int i = 0; i < R * C; ++i) acc[i / C][i % C] = _mm256_setzero_ps();
  int64_t at = (j0 / kTile) * p.K * kTile + 8 * c0;
  const char* base = BF16 ? reinterpret_cast<const char*>(p.wh) : reinterpret_cast<const char*>(p.w);
  const float* x = p.x + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k, at += kTile) {
    for (int c = 0; c < C; c += 2) _mm_prefetch(base + (at + 32 * kTile + 8 * c) * bytes, _MM_HINT_T0);
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(x[r * p.K + k]);
#pragma GCC unroll 6
    for (int c = 0; c < C; ++c) {
      const __m256 wv = tile_vector<BF16>(p, at + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xb[r], wv, acc[r][c]);
    }
  }
  float* y = p.y + m0 * p.N + j0 + 8 * c0;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < R * C; ++i) {
    const int64_t left = p.N - j0 - 8 * (c0 + i % C);  // outputs of this vector inside N
    const __m256i in = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(left, 0, 8)));
    const __m256i mask = _mm256_cmpgt_epi32(in, lane);
    _mm256_maskstore_ps(y + (i / C) * p.N + 8 * (i % C), mask, acc[i / C][i % C]);
  }
}

template <int R, bool BF16>
void kt_halves(const Dense& p, int64_t j0, int64_t m0) {
  kt_part<3, R, BF16>(p, j0, 0, m0);
  kt_part<3, R, BF16>(p, j0, 3, m0);
}

// n0: a multiple of kTile. Input rows in groups of at most 3, as even as their count allows.
template <bool BF16>
void kt_rows_of(const Dense& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.M + 2) / 3;
  for (int64_t j = n0; j < n1; j += kTile) {
    if (p.M == 1) {
      kt_part<6, 1, BF16>(p, j, 0, 0);
      continue;
    }
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t r = (p.M - m + groups - g - 1) / (groups - g);
      r == 3 ? kt_halves<3, BF16>(p, j, m) : r == 2 ? kt_halves<2, BF16>(p, j, m) : kt_halves<1, BF16>(p, j, m);
      m += r;
    }
  }
}

void kt_rows(const Dense& p, int64_t n0, int64_t n1) {
  p.wh ? kt_rows_of<true>(p, n0, n1) : kt_rows_of<false>(p, n0, n1);
}
#endif  // JAXSPEC_AVX512

// W's data into p: float32, or (column tiles only) bfloat16; false when it is neither.
bool weight_data(const ffi::AnyBuffer& w, bool tiles, Dense& p) {
  if (w.element_type() == ffi::DataType::F32) {
    p.w = static_cast<const float*>(w.untyped_data());
    return true;
  }
  if (tiles && w.element_type() == ffi::DataType::BF16) {
    p.wh = static_cast<const uint16_t*>(w.untyped_data());
    return true;
  }
  return false;
}

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> y, bool nk, bool gather) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (!nk && !gather && wd.size() == 3) {  // W in column tiles [T, K, kTile]
    if (xd.size() != 2 || yd.size() != 2 || wd[1] != xd[1] || wd[2] != kTile || wd[0] != (yd[1] + kTile - 1) / kTile)
      return ffi::Error::InvalidArgument("dense_matmul: expects x [M, K] and W tiles [ceil(N / 48), K, 48]");
    Dense p{x.typed_data(), nullptr, nullptr, y->typed_data(), xd[0], yd[1], xd[1], 0};
    if (!weight_data(w, true, p)) return ffi::Error::InvalidArgument("dense_matmul: W tiles are float32 or bfloat16");
    if (p.M > 0 && p.N > 0)
      parallel(pool, p.N, kTile, 1, p.N * p.K * (p.M + 1), [p](int64_t n0, int64_t n1) { kt_rows(p, n0, n1); });
    return ffi::Error::Success();
  }
#if defined(JAXSPEC_AVX512)
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[nk ? 1 : 0] != xd[1] || (gather && !nk) ||
      yd[1] != (gather ? idx.element_count() : wd[nk ? 0 : 1]))
    return ffi::Error::InvalidArgument("dense_matmul: expects x [M, K] and W [K, N] (or [V, K] with nk, rows idx [N])");
  Dense p{x.typed_data(), nullptr, gather ? idx.typed_data() : nullptr, y->typed_data(), xd[0], yd[1], xd[1], wd[0]};
  if (!weight_data(w, false, p)) return ffi::Error::InvalidArgument("dense_matmul: W is float32");
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (nk)
    parallel(pool, p.N, 4, 4, p.N * p.K * (p.M + 1), [p](int64_t n0, int64_t n1) { nk_rows(p, n0, n1); });
  else
    parallel(pool, p.N, 64, 1, p.N * p.K * (p.M + 1), [p](int64_t n0, int64_t n1) { kn_rows(p, n0, n1); });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dense_matmul: without AVX-512 only W in column tiles [ceil(N / 48), K, 48]");
#endif
}

// Several weights W_i [K, N_i] applied to the same x [M, K] in one call (a layer's q, k, v or gate and up),
// y_i = x @ W_i: the same sums as one DenseMatmul per weight, with one hand-off to the threads instead of one
// per weight. Columns are dealt out over the weights laid side by side, each padded to whole tiles (64
// columns for W_i [K, N_i], 48 for W_i in column tiles [T_i, K, 48]; all weights of a call are one or the other).
// SmolLM2's decode step makes 120 product calls instead of 210, which made its AR decode faster
// (docs/benchmarks/cpu.md, "AR's own products on the float kernel").
ffi::Error DenseMany(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() != ys.size() || ws.size() == 0)
    return ffi::Error::InvalidArgument("dense_many: expects x [M, K] and as many weights W_i [K, N_i] as results");
  std::vector<Dense> parts;
  std::vector<int64_t> start;  // where weight i's columns begin in the padded side-by-side layout
  int64_t total = 0, work = 0;
  const bool tiled = ws.get<ffi::AnyBuffer>(0).has_value() && ws.get<ffi::AnyBuffer>(0)->dimensions().size() == 3;
#if !defined(JAXSPEC_AVX512)
  if (!tiled) return ffi::Error::InvalidArgument("dense_many: without AVX-512 only weights in column tiles");
#endif
  const int64_t tile = tiled ? kTile : 64;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    Dense part{x.typed_data(), nullptr, nullptr, nullptr, xd[0], 0, xd[1], 0};
    if (!w.has_value() || !y.has_value() || !weight_data(*w, tiled, part))
      return ffi::Error::InvalidArgument("dense_many: weights are float32 (tiles: or bfloat16), results float32");
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    const bool ok = yd.size() == 2 && yd[0] == xd[0] &&
                    (tiled ? wd.size() == 3 && wd[1] == xd[1] && wd[2] == kTile && wd[0] == (yd[1] + kTile - 1) / kTile
                           : wd.size() == 2 && wd[0] == xd[1] && yd[1] == wd[1]);
    if (!ok)
      return ffi::Error::InvalidArgument("dense_many: expects x [M, K], y_i [M, N_i] and weights all W_i [K, N_i] "
                                         "or all W_i tiles [ceil(N_i / 48), K, 48]");
    part.y = (*y)->typed_data();
    part.N = yd[1];
    parts.push_back(part);
    start.push_back(total);
    total += (yd[1] + tile - 1) / tile * tile;
    work += yd[1] * xd[1] * (xd[0] + 1);
  }
  if (xd[0] == 0 || total == 0) return ffi::Error::Success();
  parallel(pool, total, tile, 1, work, [parts, start, tiled](int64_t n0, int64_t n1) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(n0, start[i]) - start[i], hi = std::min(n1 - start[i], parts[i].N);
#if defined(JAXSPEC_AVX512)
      if (lo < hi) (tiled ? kt_rows : kn_rows)(parts[i], lo, hi);
#else
      if (lo < hi) kt_rows(parts[i], lo, hi);
#endif
    }
  });
  return ffi::Error::Success();
}

#if defined(JAXSPEC_AVX512)
// Row-wise argmax: x [M, V] -> y [M] int32, the first maximum, or the first NaN when a row has one (the rule of
// jnp.argmax). XLA:CPU forms it from a max reduction and an index reduction over an [M, V] mask it writes out,
// a visible share of a round for a 9-node verify's [9, 49152] logits (docs/benchmarks/cpu.md, "The tree built on
// the draft vocabulary"); this reads each row twice from cache.
ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1 || y->element_count() != xd[0])
    return ffi::Error::InvalidArgument("argmax: expects x [M, V] with V >= 1 and y [M]");
  const int64_t M = xd[0], V = xd[1];
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x.typed_data() + m * V;
    int64_t at = 0;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t k = 0; k < V; k += 16) {
      const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, V - k)) - 1);
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, r + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_max_ps(best, v);
    }
    const float top = _mm512_reduce_max_ps(best);
    for (int64_t k = 0; k < V; k += 16) {  // the first NaN if there is one, else the first lane equal to the max
      const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, V - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(in, r + k);
      const __mmask16 hit = in & (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ));
      if (hit) {
        at = k + __builtin_ctz(hit);
        break;
      }
    }
    y->typed_data()[m] = static_cast<int32_t>(at);
  }
  return ffi::Error::Success();
}


// Attention of N new tokens over a KV cache: o [B, N, H, D] from q [B, N, H, D], the cache k_old, v_old
// [B, KVH, T, D] (row b's slots < length[b] committed), this forward's k_new, v_new [B, N, KVH, D] and mask
// [B, N, M] over the written cache, M = T or T + N for a ring (old slot j visible when j < length[b] and
// mask[j]; new key i when mask[s0 + i], s0 = clamp(length[b], 0, M - N)). Query head h reads KV head h / (H / KVH). Scores are q.k * scale (then
// softcap * tanh(. / softcap) when softcap > 0), softmax in float32; a row that sees nothing averages all
// T + N values (what a finite -1e30 fill gives; only padding rows). Reference: attention.attend_and_write's
// XLA form. Why it exists: XLA:CPU spends several small batched products, transposes and a softmax over
// the whole buffer per layer (a large share of a SmolLM2 verify round or decode step; docs/benchmarks/cpu.md,
// "The attention kernel");
// this reads only the committed slots, once per query group.
inline __m512 exp512(__m512 x) {  // e^x for x <= 0 (softmax): Cody-Waite range reduction, degree-7 Taylor
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 e = _mm512_set1_ps(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);  // e^x < 1.6e-38 (or -inf)
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), e, n);
}


struct Attn {
  const float *q, *k_old, *v_old, *k_new, *v_new;
  const bool* mask;
  const int32_t* length;  // [B]
  float* o;
  int64_t B, N, H, KVH, T, D, M;  // M: the mask's columns
  float scale, softcap;
};

// Query rows [r_lo, r_hi) of KV head kvh in batch row b, of its G heads x N new tokens (row g * N + n). With 24
// rows or more the keys are laid out transposed (KT [D, S], S = length[b] + N, rounded up to 32) so scores come
// 32 keys to two vectors for 4 rows at a time; the softmax runs over S, then P [rows, S] x V. Buffers are the
// caller's, reused across heads.
struct AttnScratch {
  std::vector<float> kt, s;
  std::vector<uint8_t> vis, empty;
};

// Lane i of the result = the sum of v[i]'s 16 lanes: pairs interleaved and added, 16 -> 8 -> 4 vectors within
// 128-bit lanes, then across them (45 operations for what 16 _mm512_reduce_add_ps do in about 130).
inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  auto lanes = [](__m512 a, __m512 b) {  // [a.L0 + a.L1, a.L2 + a.L3, b.L0 + b.L1, b.L2 + b.L3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return lanes(lanes(u[0], u[1]), lanes(u[2], u[3]));
}

void attend_head(const Attn& a, int64_t b, int64_t kvh, int64_t r_lo, int64_t r_hi, AttnScratch& w) {
  const int64_t G = a.H / a.KVH, L = std::clamp<int64_t>(a.length[b], 0, a.T), s0 = std::clamp<int64_t>(a.length[b], 0, a.M - a.N);
  const int64_t D = a.D, N = a.N, S = L + N, SP = (S + 31) / 32 * 32, R = r_hi - r_lo;
  const float* kc = a.k_old + (b * a.KVH + kvh) * a.T * D;
  const float* vc = a.v_old + (b * a.KVH + kvh) * a.T * D;
  auto key = [&](int64_t j) { return j < L ? kc + j * D : a.k_new + ((b * N + j - L) * a.KVH + kvh) * D; };
  auto val = [&](int64_t j) { return j < L ? vc + j * D : a.v_new + ((b * N + j - L) * a.KVH + kvh) * D; };
  w.s.resize(R * SP);
  w.vis.resize(N * SP);
  w.empty.assign(R, 0);
  for (int64_t n = 0; n < N; ++n) {  // which of the S keys token n sees
    const bool* m = a.mask + (b * N + n) * a.M;
    uint8_t* v = w.vis.data() + n * SP;
    for (int64_t j = 0; j < L; ++j) v[j] = m[j];
    for (int64_t i = 0; i < N; ++i) v[L + i] = m[s0 + i];
    for (int64_t j = S; j < SP; ++j) v[j] = 0;
  }
  // local row r is head row r_lo + r = g * N + n: head kvh * G + g, token n
  auto qrow = [&](int64_t r) { r += r_lo; return a.q + ((b * N + r % N) * a.H + kvh * G + r / N) * D; };
  auto orow = [&](int64_t r) { r += r_lo; return a.o + ((b * N + r % N) * a.H + kvh * G + r / N) * D; };
  if (R < 24) {  // a decode step's or a small tree's rows: dot products as stored (transposing costs more),
    for (int64_t r = 0; r < R; ++r) {  // 16 keys at a time, their 16 sums reduced together (sum16)
      const float* q = qrow(r);
      for (int64_t j0 = 0; j0 < SP; j0 += 16) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const float* k = key(std::min(j0 + i, S - 1));  // keys past S: scores masked below
          acc[i] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
          for (int64_t d = 16; d < D; d += 16) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc[i]);
        }
        _mm512_storeu_ps(w.s.data() + r * SP + j0, sum16(acc));
      }
    }
  } else {  // keys transposed (KT [D, SP]), then 4 rows x 32 keys per step
    w.kt.assign(D * SP, 0.0f);
    for (int64_t j = 0; j < S; ++j) {
      const float* k = key(j);
      for (int64_t d = 0; d < D; ++d) w.kt[d * SP + j] = k[d];
    }
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rn = std::min<int64_t>(4, R - r0);
      const float* qs[4];
      for (int i = 0; i < 4; ++i) qs[i] = qrow(r0 + std::min<int64_t>(i, rn - 1));
      for (int64_t j = 0; j < SP; j += 32) {
        __m512 acc[4][2];
        for (int i = 0; i < 8; ++i) acc[i / 2][i % 2] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m512 k0 = _mm512_loadu_ps(w.kt.data() + d * SP + j), k1 = _mm512_loadu_ps(w.kt.data() + d * SP + j + 16);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const __m512 qd = _mm512_set1_ps(qs[i][d]);
            acc[i][0] = _mm512_fmadd_ps(qd, k0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(qd, k1, acc[i][1]);
          }
        }
        for (int i = 0; i < rn; ++i) {
          _mm512_storeu_ps(w.s.data() + (r0 + i) * SP + j, acc[i][0]);
          _mm512_storeu_ps(w.s.data() + (r0 + i) * SP + j + 16, acc[i][1]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // softmax over the visible keys
    float* s = w.s.data() + r * SP;
    const uint8_t* v = w.vis.data() + ((r_lo + r) % N) * SP;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < SP; j += 16) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(a.scale));
      if (a.softcap > 0.0f) {
        alignas(64) float t[16];
        _mm512_store_ps(t, x);
        for (float& e : t) e = a.softcap * std::tanh(e / a.softcap);
        x = _mm512_load_ps(t);
      }
      const __mmask16 seen = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j)),
                                                _mm_set1_epi8(1));
      x = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x);
      _mm512_storeu_ps(s + j, x);
      top = _mm512_max_ps(top, x);
    }
    const float mx = _mm512_reduce_max_ps(top);
    if (mx == -INFINITY) {  // nothing visible: the uniform average of all T + N values (a -1e30 fill's result)
      float* out = orow(r);
      for (int64_t d = 0; d < D; ++d) {
        float t = 0.0f;
        for (int64_t j = 0; j < a.T; ++j) t += vc[j * D + d];
        for (int64_t i = 0; i < N; ++i) t += a.v_new[((b * N + i) * a.KVH + kvh) * D + d];
        out[d] = t / static_cast<float>(a.T + N);
      }
      std::fill(s, s + SP, 0.0f);
      w.empty[r] = 1;  // its output is written
      continue;
    }
    __m512 tot = _mm512_setzero_ps();
    for (int64_t j = 0; j < SP; j += 16) {
      const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(s + j, p);
      tot = _mm512_add_ps(tot, p);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(tot));
    for (int64_t j = 0; j < SP; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  }
  // P x V: 4 rows x 64 outputs per step
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rn = std::min<int64_t>(4, R - r0);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t cw = std::min<int64_t>(4, (D - d0) / 16);
      __m512 acc[4][4];
      for (int i = 0; i < 16; ++i) acc[i / 4][i % 4] = _mm512_setzero_ps();
      for (int64_t j = 0; j < S; ++j) {
        const float* vj = val(j) + d0;
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = c < cw ? _mm512_loadu_ps(vj + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m512 p = _mm512_set1_ps(w.s[(r0 + std::min<int64_t>(i, rn - 1)) * SP + j]);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(p, vv[c], acc[i][c]);
        }
      }
      for (int i = 0; i < rn; ++i) {
        if (w.empty[r0 + i]) continue;
        for (int c = 0; c < cw; ++c) _mm512_storeu_ps(orow(r0 + i) + d0 + 16 * c, acc[i][c]);
      }
    }
  }
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_old,
                          ffi::Buffer<ffi::F32> v_old, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                          ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> length, ffi::ResultBuffer<ffi::F32> o,
                          float scale, float softcap) {
  auto qd = q.dimensions(), kd = k_old.dimensions(), nd = k_new.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || nd.size() != 4 || md.size() != 3 ||
      length.element_count() != static_cast<size_t>(qd[0]) ||
      kd[0] != qd[0] || kd[1] == 0 || qd[2] % kd[1] || kd[3] != qd[3] || nd[0] != qd[0] || nd[1] != qd[1] ||
      nd[2] != kd[1] || nd[3] != qd[3] || md[0] != qd[0] || md[1] != qd[1] || md[2] < kd[2] ||
      v_old.element_count() != k_old.element_count() || v_new.element_count() != k_new.element_count() || md[2] < nd[1])
    return ffi::Error::InvalidArgument("cache_attention: expects q [B, N, H, D], k/v_old [B, KVH, T, D], "
                                       "k/v_new [B, N, KVH, D], mask [B, N, M], length [B] with KVH | H and T, N <= M");
  if (qd[3] % 16) return ffi::Error::InvalidArgument("cache_attention: head_dim must be a multiple of 16");
  Attn a{q.typed_data(), k_old.typed_data(), v_old.typed_data(), k_new.typed_data(), v_new.typed_data(),
         mask.typed_data(), length.typed_data(), o->typed_data(), qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], md[2],
         scale, softcap};
  if (a.B * a.N * a.H == 0) return ffi::Error::Success();
  int64_t longest = 0;
  for (int64_t b = 0; b < a.B; ++b) longest = std::max<int64_t>(longest, std::clamp<int64_t>(a.length[b], 0, a.T));
  // Items: (batch row, KV head, part of its G x N query rows); a verify's heads split in two so that two
  // threads share 3 KV heads evenly.
  const int64_t R = a.H / a.KVH * a.N, parts = R >= 16 ? 2 : 1;
  parallel(pool, a.B * a.KVH * parts, 1, 1, a.B * a.N * a.H * (longest + a.N) * a.D, [a, R, parts](int64_t i0, int64_t i1) {
    AttnScratch w;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t part = i % parts, head = i / parts;
      attend_head(a, head / a.KVH, head % a.KVH, R * part / parts, R * (part + 1) / parts, w);
    }
  }, 1);
  return ffi::Error::Success();
}

#endif  // JAXSPEC_AVX512 (argmax, attention)

}  // namespace

#if defined(JAXSPEC_AVX512)
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_packed_matmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("with_offset"));

#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_dense_matmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nk")
                                  .Attr<bool>("gather"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_dense_many, DenseMany,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

#if defined(JAXSPEC_AVX512)
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_argmax, Argmax,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxspec_cache_attention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
#endif  // JAXSPEC_AVX512
#endif  // AVX-512, or AVX2 and FMA
