// x @ W for int8 group-quantized weights on CPUs, called from XLA through jax's FFI.
//
// Contract (jaxserve.quantization.linear_reference is the oracle): x f32 [rows, in]; q int8
// [out, in]; scales f32 [out, in / 32] (symmetric, one scale per 32 consecutive inputs of an
// output, GGUF Q8_0's blocks); y f32 [rows, out] with y[r, o] = sum_k x[r, k] * q[o, k] * s[o, k/32].
//
// Why a kernel: XLA's CPU backend dequantizes int8 weights ~10x slower than it reads f32 ones, so
// 8-bit weights only pay off through code of our own. The weights are stored [out, in] (each
// output's weights contiguous, the scales' groups along them): a decode row streams them in order.
//
// One template computes every instruction set: this file includes itself once per target (AVX-512,
// AVX2+FMA, portable), each time under `#pragma GCC target` with that target's vector operations
// (`Ops`), so the same code is compiled three times; the entry is chosen at run time from what
// the CPU reports (the library is built without -march=native, so one build runs anywhere). A
// micro-kernel holds R rows x O outputs of accumulators in registers; each weight vector is
// converted and scaled once and used for R rows.

#ifndef JX_KERNEL_BODY

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowChunk = 64;  // rows per work item: x of a chunk stays in L2 while its weights stream
constexpr int64_t kOutChunk = 64;  // outputs per work item
constexpr int kOut = 4;            // outputs per micro-kernel
// Below this many multiply-adds a call runs on the calling thread alone: waking a helper costs
// more than it saves on the small projections of a decode step.
constexpr int64_t kParallelWork = 1 << 18;

#define JX_INLINE inline __attribute__((always_inline))

struct Problem {
  const float* x;
  const int8_t* q;
  const float* s;
  float* y;
  int64_t rows, in, out, groups;
};

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
  static JX_INLINE V LoadQ(const int8_t* p) { return V{{float(p[0]), float(p[1]), float(p[2]), float(p[3])}}; }
  static JX_INLINE V Mul(V a, V b) { for (int i = 0; i < 4; ++i) a.v[i] *= b.v[i]; return a; }
  static JX_INLINE V Fma(V a, V b, V c) { for (int i = 0; i < 4; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  static JX_INLINE float HSum(V a) { return (a.v[0] + a.v[1]) + (a.v[2] + a.v[3]); }
};
}  // namespace portable
#define JX_NS portable
#include __FILE__
#undef JX_NS

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct Ops {  // 16 ymm registers: 8 accumulators (2 rows x 4 outputs) + 4 weights + x
  using V = __m256;
  static constexpr int kLanes = 8, kRows = 2;
  static JX_INLINE V Zero() { return _mm256_setzero_ps(); }
  static JX_INLINE V Set1(float a) { return _mm256_set1_ps(a); }
  static JX_INLINE V LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static JX_INLINE V LoadQ(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static JX_INLINE V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static JX_INLINE V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static JX_INLINE float HSum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
}  // namespace avx2
#define JX_NS avx2
#include __FILE__
#undef JX_NS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
struct Ops {  // 32 zmm registers: 16 accumulators (4 rows x 4 outputs) + 4 weights + x
  using V = __m512;
  static constexpr int kLanes = 16, kRows = 4;
  static JX_INLINE V Zero() { return _mm512_setzero_ps(); }
  static JX_INLINE V Set1(float a) { return _mm512_set1_ps(a); }
  static JX_INLINE V LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static JX_INLINE V LoadQ(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static JX_INLINE V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static JX_INLINE V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static JX_INLINE float HSum(V a) { return _mm512_reduce_add_ps(a); }
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

// R rows of x (stride `in`) times O weight rows (stride `in`) -> y[R][O] (row stride `out`).
template <int R, int O>
JX_INLINE void Micro(const float* x, const int8_t* q, const float* s, float* y, int64_t in, int64_t out) {
  using V = Ops::V;
  constexpr int N = Ops::kLanes;
  const int64_t groups = in / kGroup;
  V acc[R][O];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) acc[i][j] = Ops::Zero();
  for (int64_t g = 0; g < groups; ++g) {
    V sc[O];
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) sc[j] = Ops::Set1(s[j * groups + g]);
#pragma GCC unroll 8
    for (int h = 0; h < kGroup; h += N) {
      const int64_t k = g * kGroup + h;
      V w[O];
#pragma GCC unroll 4
      for (int j = 0; j < O; ++j) w[j] = Ops::Mul(Ops::LoadQ(q + j * in + k), sc[j]);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const V xv = Ops::LoadF(x + i * in + k);
#pragma GCC unroll 4
        for (int j = 0; j < O; ++j) acc[i][j] = Ops::Fma(xv, w[j], acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < O; ++j) y[i * out + j] = Ops::HSum(acc[i][j]);
}

// Rows [r0, r1) x outputs [o0, o1): output quads outer (their weights stay in L1 across the
// rows), row blocks of kRows inner.
void Tile(const Problem& p, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  constexpr int RMAX = Ops::kRows;
  for (int64_t o = o0; o < o1; o += kOut) {
    const int64_t no = std::min<int64_t>(kOut, o1 - o);
    const int8_t* q = p.q + o * p.in;
    const float* s = p.s + o * p.groups;
    for (int64_t r = r0; r < r1; r += RMAX) {
      const int64_t nr = std::min<int64_t>(RMAX, r1 - r);
      const float* x = p.x + r * p.in;
      float* y = p.y + r * p.out + o;
      if (no == kOut) {
        if (nr == RMAX) { Micro<RMAX, kOut>(x, q, s, y, p.in, p.out); continue; }
        if (nr == 1) { Micro<1, kOut>(x, q, s, y, p.in, p.out); continue; }
        if (RMAX > 2 && nr == 2) { Micro<2, kOut>(x, q, s, y, p.in, p.out); continue; }
        if (RMAX > 3 && nr == 3) { Micro<3, kOut>(x, q, s, y, p.in, p.out); continue; }
      }
      // Tails: one output at a time (at most 3 outputs of a matrix take this path).
      for (int64_t j = 0; j < no; ++j)
        for (int64_t i = 0; i < nr; ++i)
          Micro<1, 1>(x + i * p.in, q + j * p.in, s + j * p.groups, y + i * p.out + j, p.in, p.out);
    }
  }
}

}  // namespace JX_NS

#endif  // JX_KERNEL_BODY

#ifndef JX_KERNEL_BODY
enum Isa : int32_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

int32_t BestIsa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

TileFn PickTile(int32_t isa) {
  const int32_t best = BestIsa();
  if (isa == kAuto) isa = best;
  if (isa > best) return nullptr;
#if defined(__x86_64__)
  if (isa == kAvx512) return avx512::Tile;
  if (isa == kAvx2) return avx2::Tile;
#endif
  return isa == kPortable ? portable::Tile : nullptr;
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

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::Buffer<ffi::F32> scales, int32_t isa, int32_t threads, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("int8 matmul: x [rows, in], q [out, in], scales [out, in/32], y [rows, out]");
  const int64_t rows = xd[0], in = xd[1], out = qd[0];
  if (qd[1] != in || in % kGroup != 0 || sd[0] != out || sd[1] != in / kGroup || yd[0] != rows || yd[1] != out)
    return ffi::Error::InvalidArgument("int8 matmul: shapes disagree (in must be a multiple of 32)");
  TileFn tile = PickTile(isa);
  if (tile == nullptr) return ffi::Error::InvalidArgument("int8 matmul: this CPU lacks the instruction set asked for");
  if (rows == 0 || out == 0) return ffi::Error::Success();
  auto job = std::make_shared<Job>();
  job->p = Problem{x.typed_data(), q.typed_data(), scales.typed_data(), y->typed_data(), rows, in, out, in / kGroup};
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

}  // namespace

extern "C" int32_t JaxserveInt8BestIsa() { return BestIsa(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8MatmulF32, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());

#endif  // !JX_KERNEL_BODY
