// x @ W for group-quantized weights on CPUs, called from XLA through jax's FFI.
//
// Contract (jaxserve.quantization.linear_reference is the oracle): x f32 [rows, in]; the weights
// in groups of 32 consecutive inputs of an output, each group with a scale s [out, in/32] and, in
// the affine formats, an offset m [out, in/32], both float32 or both float16 (GGUF stores Q8_0's,
// Q4_0's and Q4_1's as float16: kept so, a quarter of the bytes a 4-bit decode step reads);
// y f32 [rows, out] with
// y[r, o] = sum_k x[r, k] * w[o, k], where per format
//   q8   (GGUF Q8_0's blocks)  q int8 [out, in]         w = q * s
//   q8a  (affine int8)         q int8 [out, in]         w = q * s + m
//   q4a  (GGUF Q4_0 / Q4_1's)  q uint8 [out, in / 2]    w = nibble * s + m; a group's 16 bytes hold
//                              its elements i (low nibble) and i + 16 (high nibble), as GGUF does.
//
// Why a kernel: XLA's CPU backend dequantizes int8 weights ~10x slower than it reads f32 ones, so
// 8- and 4-bit weights only pay off through code of our own. The weights are stored [out, in]
// (each output's weights contiguous, the groups along them): a decode row streams them in order.
//
// One template computes every instruction set: this file includes itself once per target (AVX-512,
// AVX2+FMA, portable), each time under `#pragma GCC target` with that target's vector operations
// (`Ops`), so the same code is compiled three times; the entry is chosen at run time from what
// the CPU reports (the library is built without -march=native, so one build runs anywhere). A
// micro-kernel holds R rows x O outputs of accumulators in registers. With few rows each weight
// vector is converted once and used for those R rows; with many (prefill, big batches), an
// O-output panel of weights is converted to float32 once per work item and reused by all its rows,
// so that the conversion does not make the kernel slower than a float32 matmul where it is
// compute-bound.

#ifndef JX_KERNEL_BODY

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowChunk = 64;  // rows per work item: x of a chunk stays in L2 while its weights stream
constexpr int64_t kOutChunk = 64;  // outputs per work item
constexpr int kOut = 4;            // outputs per micro-kernel
// From this many rows in a work item on, its weights are converted to a float32 panel first.
constexpr int64_t kPanelRows = 16;
// Weights come from DRAM once per call (a decode step streams the whole model, more than the
// caches hold): each output quad asks for the bytes of the quad this many ahead (software
// prefetch; the hardware streamers alone left a 1-row call at ~6 GB/s a core here).
constexpr int64_t kPrefetchQuads = 4;
// Below this many multiply-adds a call runs on the calling thread alone: waking a helper costs
// more than it saves on the small projections of a decode step.
constexpr int64_t kParallelWork = 1 << 18;

#define JX_INLINE inline __attribute__((always_inline))

enum Format : int32_t { kQ8 = 0, kQ8A = 1, kQ4A = 2 };

struct Problem {
  const float* x;
  const uint8_t* q;
  const void* s;  // float or float16 (uint16_t) scales, as the handler was bound
  const void* m;  // offsets of the same type; null for q8
  float* y;
  int64_t rows, in, out, groups, row_bytes;  // row_bytes: one output's quantized weights
  int64_t scale_bytes;                       // 4 or 2
};

// float16 bits -> float, portably (the x86 targets use F16C's instruction instead).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = std::ldexp(float(man), -24);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t);

}  // namespace

#define JX_KERNEL_BODY

// Portable: plain scalar code, 4 "lanes" the compiler may vectorise with the baseline ISA.
namespace portable {
struct Ops {
  struct V { float v[4]; };
  static constexpr int kLanes = 4, kRows = 2;
  static JX_INLINE V Zero() { return V{{0, 0, 0, 0}}; }
  static JX_INLINE V Set1(float a) { return V{{a, a, a, a}}; }
  static JX_INLINE V LoadF(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static JX_INLINE void StoreF(float* p, V a) { std::memcpy(p, a.v, sizeof a.v); }
  static JX_INLINE V LoadQ8(const uint8_t* p) {
    const auto* s = reinterpret_cast<const int8_t*>(p);
    return V{{float(s[0]), float(s[1]), float(s[2]), float(s[3])}};
  }
  static JX_INLINE V LoadQ4(const uint8_t* p, int shift) {
    return V{{float((p[0] >> shift) & 15), float((p[1] >> shift) & 15), float((p[2] >> shift) & 15),
              float((p[3] >> shift) & 15)}};
  }
  static JX_INLINE V Mul(V a, V b) { for (int i = 0; i < 4; ++i) a.v[i] *= b.v[i]; return a; }
  static JX_INLINE V Fma(V a, V b, V c) { for (int i = 0; i < 4; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  static JX_INLINE float HSum(V a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
  static JX_INLINE void Halfs(const uint16_t* h, float* f, int64_t n) {
    for (int64_t i = 0; i < n; ++i) f[i] = HalfToFloat(h[i]);
  }
};
}  // namespace portable
#define JX_NS portable
#include __FILE__
#undef JX_NS

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct Ops {  // 16 ymm registers: 8 accumulators (2 rows x 4 outputs) + 4 weights + x
  using V = __m256;
  static constexpr int kLanes = 8, kRows = 2;
  static JX_INLINE V Zero() { return _mm256_setzero_ps(); }
  static JX_INLINE V Set1(float a) { return _mm256_set1_ps(a); }
  static JX_INLINE V LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static JX_INLINE void StoreF(float* p, V a) { _mm256_storeu_ps(p, a); }
  static JX_INLINE V LoadQ8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static JX_INLINE V LoadQ4(const uint8_t* p, int shift) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    b = _mm_and_si128(_mm_srli_epi16(b, shift), _mm_set1_epi8(15));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  }
  static JX_INLINE V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static JX_INLINE V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static JX_INLINE float HSum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static JX_INLINE void Halfs(const uint16_t* h, float* f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
  }
};
}  // namespace avx2
#define JX_NS avx2
#include __FILE__
#undef JX_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
namespace avx512 {
struct Ops {  // 32 zmm registers: 16 accumulators (4 rows x 4 outputs) + 4 weights + x (+ scales)
  using V = __m512;
  static constexpr int kLanes = 16, kRows = 4;
  static JX_INLINE V Zero() { return _mm512_setzero_ps(); }
  static JX_INLINE V Set1(float a) { return _mm512_set1_ps(a); }
  static JX_INLINE V LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static JX_INLINE void StoreF(float* p, V a) { _mm512_storeu_ps(p, a); }
  static JX_INLINE V LoadQ8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static JX_INLINE V LoadQ4(const uint8_t* p, int shift) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    b = _mm_and_si128(_mm_srli_epi16(b, shift), _mm_set1_epi8(15));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
  static JX_INLINE V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static JX_INLINE V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static JX_INLINE float HSum(V a) { return _mm512_reduce_add_ps(a); }
  static JX_INLINE void Halfs(const uint16_t* h, float* f, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
    for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
  }
};
}  // namespace avx512
#define JX_NS avx512
#include __FILE__
#undef JX_NS
#pragma GCC pop_options
#endif

#undef JX_KERNEL_BODY

namespace {

#else  // JX_KERNEL_BODY: the generic kernel, compiled once per target inside namespace JX_NS

namespace JX_NS {

using V = Ops::V;
constexpr int N = Ops::kLanes;

// One format's group layout: the bytes of a group and its h-th..h+N-th elements as floats.
template <int32_t F> struct Fmt;
template <> struct Fmt<kQ8> {
  static constexpr int64_t kBytes = kGroup;
  static constexpr bool kAffine = false;
  static JX_INLINE V Load(const uint8_t* group, int h) { return Ops::LoadQ8(group + h); }
};
template <> struct Fmt<kQ8A> : Fmt<kQ8> { static constexpr bool kAffine = true; };
template <> struct Fmt<kQ4A> {
  static constexpr int64_t kBytes = kGroup / 2;
  static constexpr bool kAffine = true;
  static JX_INLINE V Load(const uint8_t* group, int h) { return Ops::LoadQ4(group + (h & 15), h < 16 ? 0 : 4); }
};

// R rows of x (stride `in`) times O quantized weight rows -> y[R][O] (row stride `out`).
template <int32_t F, int R, int O>
JX_INLINE void Micro(const Problem& p, const float* x, const uint8_t* q, const float* s, const float* m, float* y) {
  using W = Fmt<F>;
  V acc[R][O];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) acc[i][j] = Ops::Zero();
  for (int64_t g = 0; g < p.groups; ++g) {
    V sc[O], mn[O];
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) {
      sc[j] = Ops::Set1(s[j * p.groups + g]);
      if constexpr (W::kAffine) mn[j] = Ops::Set1(m[j * p.groups + g]);
    }
#pragma GCC unroll 8
    for (int h = 0; h < kGroup; h += N) {
      const int64_t k = g * kGroup + h;
      V w[O];
#pragma GCC unroll 4
      for (int j = 0; j < O; ++j) {
        const V raw = W::Load(q + j * p.row_bytes + g * W::kBytes, h);
        if constexpr (W::kAffine) w[j] = Ops::Fma(raw, sc[j], mn[j]);
        else w[j] = Ops::Mul(raw, sc[j]);
      }
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const V xv = Ops::LoadF(x + i * p.in + k);
#pragma GCC unroll 4
        for (int j = 0; j < O; ++j) acc[i][j] = Ops::Fma(xv, w[j], acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) y[i * p.out + j] = Ops::HSum(acc[i][j]);
}

// O quantized weight rows -> float32 panel [O][in].
template <int32_t F, int O>
JX_INLINE void ToPanel(const Problem& p, const uint8_t* q, const float* s, const float* m, float* panel) {
  using W = Fmt<F>;
  for (int j = 0; j < O; ++j)
    for (int64_t g = 0; g < p.groups; ++g) {
      const V sc = Ops::Set1(s[j * p.groups + g]);
      const V mn = W::kAffine ? Ops::Set1(m[j * p.groups + g]) : Ops::Zero();
      for (int h = 0; h < kGroup; h += N) {
        const V raw = W::Load(q + j * p.row_bytes + g * W::kBytes, h);
        Ops::StoreF(panel + j * p.in + g * kGroup + h, W::kAffine ? Ops::Fma(raw, sc, mn) : Ops::Mul(raw, sc));
      }
    }
}

// R rows of x times O rows of a float32 panel (stride `in`) -> y[R][O].
template <int R, int O>
JX_INLINE void MicroPanel(const Problem& p, const float* x, const float* panel, float* y) {
  V acc[R][O];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) acc[i][j] = Ops::Zero();
  for (int64_t k = 0; k < p.in; k += N) {
    V w[O];
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) w[j] = Ops::LoadF(panel + j * p.in + k);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const V xv = Ops::LoadF(x + i * p.in + k);
#pragma GCC unroll 4
      for (int j = 0; j < O; ++j) acc[i][j] = Ops::Fma(xv, w[j], acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) y[i * p.out + j] = Ops::HSum(acc[i][j]);
}

// Ask for the weight, scale and offset bytes of outputs [o, o + n) (beyond the matrix: ignored,
// a prefetch never faults).
JX_INLINE void PrefetchOutputs(const Problem& p, int64_t o, int64_t n) {
  const auto lines = [](const void* start, int64_t bytes) {
    const char* c = static_cast<const char*>(start);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
  };
  lines(p.q + o * p.row_bytes, n * p.row_bytes);
  lines(static_cast<const char*>(p.s) + o * p.groups * p.scale_bytes, n * p.groups * p.scale_bytes);
  if (p.m != nullptr)
    lines(static_cast<const char*>(p.m) + o * p.groups * p.scale_bytes, n * p.groups * p.scale_bytes);
}

// Rows [r0, r1) x outputs [o0, o1): output quads outer (their weights stay in L1 across the
// rows), row blocks of kRows inner.
template <int32_t F, typename S>
void Tile(const Problem& p, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  constexpr int RMAX = Ops::kRows;
  const bool use_panel = r1 - r0 >= kPanelRows;
  std::vector<float> panel(use_panel ? kOut * p.in : 0);
  std::vector<float> wide(std::is_same_v<S, float> ? 0 : 2 * kOut * p.groups);  // float16 scales, widened
  for (int64_t o = o0; o < o1; o += kOut) {
    const int64_t no = std::min<int64_t>(kOut, o1 - o);
    const uint8_t* q = p.q + o * p.row_bytes;
    const float* s;
    const float* m = nullptr;
    if constexpr (std::is_same_v<S, float>) {
      s = static_cast<const float*>(p.s) + o * p.groups;
      if (p.m != nullptr) m = static_cast<const float*>(p.m) + o * p.groups;
    } else {  // float16: the quad's scales and offsets widened once, vectorised (one at a time, per
              // group inside the micro-kernel, they cost more than the bytes they save)
      Ops::Halfs(static_cast<const uint16_t*>(p.s) + o * p.groups, wide.data(), no * p.groups);
      s = wide.data();
      if (p.m != nullptr) {
        Ops::Halfs(static_cast<const uint16_t*>(p.m) + o * p.groups, wide.data() + kOut * p.groups, no * p.groups);
        m = wide.data() + kOut * p.groups;
      }
    }
    if (o + kPrefetchQuads * kOut < p.out) PrefetchOutputs(p, o + kPrefetchQuads * kOut, kOut);
    if (use_panel && no == kOut) ToPanel<F, kOut>(p, q, s, m, panel.data());
    for (int64_t r = r0; r < r1; r += RMAX) {
      const int64_t nr = std::min<int64_t>(RMAX, r1 - r);
      const float* x = p.x + r * p.in;
      float* y = p.y + r * p.out + o;
      if (no == kOut) {
        if (use_panel) {
          if (nr == RMAX) { MicroPanel<RMAX, kOut>(p, x, panel.data(), y); continue; }
          for (int64_t i = 0; i < nr; ++i) MicroPanel<1, kOut>(p, x + i * p.in, panel.data(), y + i * p.out);
          continue;
        }
        if (nr == RMAX) { Micro<F, RMAX, kOut>(p, x, q, s, m, y); continue; }
        if (nr == 1) { Micro<F, 1, kOut>(p, x, q, s, m, y); continue; }
        if (RMAX > 2 && nr == 2) { Micro<F, 2, kOut>(p, x, q, s, m, y); continue; }
        if (RMAX > 3 && nr == 3) { Micro<F, 3, kOut>(p, x, q, s, m, y); continue; }
      }
      // Tails: one output at a time (at most 3 outputs of a matrix take this path).
      for (int64_t j = 0; j < no; ++j)
        for (int64_t i = 0; i < nr; ++i)
          Micro<F, 1, 1>(p, x + i * p.in, q + j * p.row_bytes, s + j * p.groups,
                         m == nullptr ? nullptr : m + j * p.groups, y + i * p.out + j);
    }
  }
}

template <typename S>
TileFn TileFor(int32_t format) {
  switch (format) {
    case kQ8: return Tile<kQ8, S>;
    case kQ8A: return Tile<kQ8A, S>;
    case kQ4A: return Tile<kQ4A, S>;
  }
  return nullptr;
}

}  // namespace JX_NS

#endif  // JX_KERNEL_BODY

#ifndef JX_KERNEL_BODY
enum Isa : int32_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

int32_t BestIsa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) return kPortable;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

template <typename S>
TileFn PickTile(int32_t isa, int32_t format) {
  const int32_t best = BestIsa();
  if (isa == kAuto) isa = best;
  if (isa > best) return nullptr;
#if defined(__x86_64__)
  if (isa == kAvx512) return avx512::TileFor<S>(format);
  if (isa == kAvx2) return avx2::TileFor<S>(format);
#endif
  return isa == kPortable ? portable::TileFor<S>(format) : nullptr;
}

struct Job {
  Problem p;
  TileFn tile;
  int64_t row_chunks, out_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  int64_t total() const { return row_chunks * out_chunks; }
  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < total();) {
      // Out chunks vary fastest: a helper works on the same rows (x in cache) as the caller.
      const int64_t rc = i / out_chunks, oc = i % out_chunks;
      tile(p, rc * kRowChunk, std::min(p.rows, (rc + 1) * kRowChunk), oc * kOutChunk,
           std::min(p.out, (oc + 1) * kOutChunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename S>
ffi::Error Run(ffi::ThreadPool& pool, int32_t format, const float* x, const uint8_t* q, const S* s, const S* m,
               float* y, int64_t rows, int64_t in, int64_t out, int32_t isa, int32_t threads) {
  TileFn tile = PickTile<S>(isa, format);
  if (tile == nullptr) return ffi::Error::InvalidArgument("quantized matmul: this CPU lacks the instruction set asked for");
  if (rows == 0 || out == 0) return ffi::Error::Success();
  auto job = std::make_shared<Job>();
  const int64_t groups = in / kGroup;
  const int64_t row_bytes = format == kQ4A ? in / 2 : in;
  job->p = Problem{x, q, s, m, y, rows, in, out, groups, row_bytes, int64_t(sizeof(S))};
  job->tile = tile;
  job->row_chunks = (rows + kRowChunk - 1) / kRowChunk;
  job->out_chunks = (out + kOutChunk - 1) / kOutChunk;
  const int64_t total = job->total();
  int64_t workers = rows * in * out >= kParallelWork ? pool.num_threads() : 1;
  if (threads > 0) workers = std::min<int64_t>(workers, threads);
  const int64_t helpers = std::min<int64_t>(workers, total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Drain(); });
  job->Drain();
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

// Shapes: x [rows, in]; q [out, in or in/2], or stacked over layers [layers, out, in or in/2]
// with `layer` picking one (the model's layer scan passes the whole stack and its index: as a scan
// input, XLA would copy each layer's slice before the call, ~11 ms a decode step for the default
// model); s and m shaped like q with in/32 last; y [rows, out].
struct Shapes {
  int64_t rows, in, out, layers;
};

template <typename QBuf, typename SBuf>
ffi::Error Check(const ffi::Buffer<ffi::F32>& x, const QBuf& q, const SBuf& s, const SBuf* m,
                 const ffi::Buffer<ffi::S32>& layer, ffi::Span<const int64_t> yd,
                 int64_t in_per_byte, Shapes& shapes) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || (qd.size() != 2 && qd.size() != 3) || sd.size() != qd.size() || yd.size() != 2)
    return ffi::Error::InvalidArgument(
        "quantized matmul: x [rows, in], q [(layers,) out, in(/2)], scales [(layers,) out, in/32], y [rows, out]");
  const size_t r = qd.size();
  const int64_t rows = xd[0], in = xd[1], out = qd[r - 2], layers = r == 3 ? qd[0] : 1;
  if (qd[r - 1] * in_per_byte != in || in % kGroup != 0 || sd[r - 2] != out || sd[r - 1] != in / kGroup ||
      (r == 3 && sd[0] != layers) || yd[0] != rows || yd[1] != out)
    return ffi::Error::InvalidArgument("quantized matmul: shapes disagree (in must be a multiple of 32)");
  if (m != nullptr) {
    const auto md = m->dimensions();
    if (md.size() != sd.size() || !std::equal(md.begin(), md.end(), sd.begin()))
      return ffi::Error::InvalidArgument("quantized matmul: offsets must have the scales' shape");
  }
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("quantized matmul: layer index out of range");
  shapes = Shapes{rows, in, out, layers};
  return ffi::Error::Success();
}

template <int32_t F, typename QBuf, typename SBuf>
ffi::Error Matmul(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, QBuf& q, SBuf& s, SBuf* m,
                  ffi::Buffer<ffi::S32>& layer, int32_t isa, int32_t threads, ffi::ResultBuffer<ffi::F32>& y) {
  Shapes sh;
  if (auto e = Check(x, q, s, m, layer, y->dimensions(), F == kQ4A ? 2 : 1, sh); e.failure()) return e;
  const int64_t l = layer.typed_data()[0], groups = sh.in / kGroup;
  const int64_t q_layer = sh.out * (F == kQ4A ? sh.in / 2 : sh.in), s_layer = sh.out * groups;
  const auto* qp = reinterpret_cast<const uint8_t*>(q.typed_data()) + l * q_layer;
  return Run(pool, F, x.typed_data(), qp, s.typed_data() + l * s_layer,
             m == nullptr ? nullptr : m->typed_data() + l * s_layer, y->typed_data(), sh.rows, sh.in, sh.out, isa,
             threads);
}

template <ffi::DataType SD>
ffi::Error Q8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<SD> s,
                    ffi::Buffer<ffi::S32> layer, int32_t isa, int32_t threads, ffi::ResultBuffer<ffi::F32> y) {
  return Matmul<kQ8>(pool, x, q, s, static_cast<ffi::Buffer<SD>*>(nullptr), layer, isa, threads, y);
}

template <ffi::DataType SD>
ffi::Error Q8AffineMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<SD> s,
                          ffi::Buffer<SD> m, ffi::Buffer<ffi::S32> layer, int32_t isa, int32_t threads,
                          ffi::ResultBuffer<ffi::F32> y) {
  return Matmul<kQ8A>(pool, x, q, s, &m, layer, isa, threads, y);
}

template <ffi::DataType SD>
ffi::Error Q4AffineMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<SD> s,
                          ffi::Buffer<SD> m, ffi::Buffer<ffi::S32> layer, int32_t isa, int32_t threads,
                          ffi::ResultBuffer<ffi::F32> y) {
  return Matmul<kQ4A>(pool, x, q, s, &m, layer, isa, threads, y);
}

}  // namespace

extern "C" int32_t JaxserveQuantBestIsa() { return BestIsa(); }

// One handler per format and scale type (F32: float32 scales; F16: float16 ones).
#define JX_BIND_NO_OFFSETS(SD)                                                                       \
  ffi::Ffi::Bind()                                                                                   \
      .Ctx<ffi::ThreadPool>()                                                                        \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                  \
      .Arg<ffi::Buffer<ffi::S8>>()                                                                   \
      .Arg<ffi::Buffer<SD>>()                                                                        \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                  \
      .Attr<int32_t>("isa")                                                                          \
      .Attr<int32_t>("threads")                                                                      \
      .Ret<ffi::Buffer<ffi::F32>>()
#define JX_BIND_OFFSETS(QD, SD)                                                                      \
  ffi::Ffi::Bind()                                                                                   \
      .Ctx<ffi::ThreadPool>()                                                                        \
      .Arg<ffi::Buffer<ffi::F32>>()                                                                  \
      .Arg<ffi::Buffer<QD>>()                                                                        \
      .Arg<ffi::Buffer<SD>>()                                                                        \
      .Arg<ffi::Buffer<SD>>()                                                                        \
      .Arg<ffi::Buffer<ffi::S32>>()                                                                  \
      .Attr<int32_t>("isa")                                                                          \
      .Attr<int32_t>("threads")                                                                      \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8MatmulF32, Q8Matmul<ffi::F32>, JX_BIND_NO_OFFSETS(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8MatmulF16, Q8Matmul<ffi::F16>, JX_BIND_NO_OFFSETS(ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8AffineMatmulF32, Q8AffineMatmul<ffi::F32>, JX_BIND_OFFSETS(ffi::S8, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8AffineMatmulF16, Q8AffineMatmul<ffi::F16>, JX_BIND_OFFSETS(ffi::S8, ffi::F16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q4AffineMatmulF32, Q4AffineMatmul<ffi::F32>, JX_BIND_OFFSETS(ffi::U8, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q4AffineMatmulF16, Q4AffineMatmul<ffi::F16>, JX_BIND_OFFSETS(ffi::U8, ffi::F16));

#endif  // !JX_KERNEL_BODY
