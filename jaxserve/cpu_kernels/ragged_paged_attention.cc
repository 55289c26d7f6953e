// Ragged paged attention for CPUs, called from XLA through jax's FFI.
//
// Same contract as jaxserve.attention.ragged_paged_attention_xla (the reference it is tested
// against): q [T, H, D]; KV pool [N, page_size, 2*KVH, D] with K of head h at 2h and V at 2h+1;
// kv_lens [S]; page_tables [S, P]; cu_q_lens [S+1]; num_seqs [1]. Row i of sequence s sits at KV
// position kv_len - q_len + i and attends causally to its own sequence (optionally a sliding
// window); padding rows come out as zeros.
//
// q (and the output) is float32 or bfloat16; the pool is q's dtype or 8-bit (int8, float8_e4m3fn:
// issue 18's KV cache). An 8-bit pool is read as its plain float value: the result is exactly the
// one for pool.astype(float32). Its scales are static per layer and KV head, so the caller folds
// them into q (K's) and the output (V's) and the kernel never sees them.
//
// Why a kernel: XLA's CPU code for this gathers pages into temporaries and runs many tiny batched
// dots; decode attention then cost a third of a decode step. Here each work item (one sequence,
// up to kRowTile of its query rows, all heads) reads its pages in place, once and in order, with
// its query vectors kept in L1, and the items are spread over XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define JAXSERVE_F16C 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowTile = 8;  // query rows of one sequence per work item

// An e4m3fn byte (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN). A type of its own so that overloads tell it from int8.
struct Fp8E4M3FN {
  uint8_t bits;
};

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }  // exact
// Exact, without float denormals (XLA's threads may flush them) and with selects written as bit
// masks (with trapping math, GCC's default, a ?: on floats stays a branch and the conversion loop
// is not vectorised): a
// normal e4m3 moved into float32's fields needs only its exponent rebiased (+120); a subnormal is
// mantissa * 2^-9, an exact int -> float times a power of two.
inline float ToFloat(Fp8E4M3FN x) {
  const uint32_t mag = x.bits & 0x7fu;
  const float sub = static_cast<float>(static_cast<int32_t>(mag)) * 0x1p-9f;
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof sub_bits);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(mag < 8u);     // all ones or zero
  const uint32_t is_nan = 0u - static_cast<uint32_t>(mag == 0x7fu);
  uint32_t u = (sub_bits & is_sub) | (((mag << 20) + (120u << 23)) & ~is_sub);
  u = (u & ~is_nan) | (0x7fc00000u & is_nan);
  u |= static_cast<uint32_t>(x.bits & 0x80u) << 24;  // the sign, of zero and NaN too
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float ToFloat(uint16_t x) {  // bfloat16 -> float32 is exact
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((u >> 16) | 0x40u);  // keep NaN a NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<uint16_t>(u >> 16);
}

// exp for x <= 0 (softmax weights), written so that the compiler vectorises the loops calling it
// (with a scalar libm call per score, one decode layer of 32 sequences took 1.65 ms, not 1.22).
// 2^n * e^r with n = round(x/ln 2), |r| <= ln(2)/2 and a degree-6 polynomial for e^r (Cephes'
// expf coefficients): about 1 ulp.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38, still a normal float; below it the weight is noise
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2 in two parts (Cody-Waite)
  float e = 1.9875691500e-4f;
  e = e * r + 1.3981999507e-3f;
  e = e * r + 8.3334519073e-3f;
  e = e * r + 4.1665795894e-2f;
  e = e * r + 1.6666665459e-1f;
  e = e * r + 5.0000001201e-1f;
  e = e * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

#ifdef JAXSERVE_F16C
// e4m3fn -> half is a shift: half's exponent field is wider (bias 15, not 7), so the bits moved
// into place read as the value times 2^-8, subnormals included; F16C converts half -> float in
// hardware, and * 256 is exact. Exact for all 256 bytes under DAZ/FTZ too (measured), and 2.4x
// faster than the vectorised ToFloat above (0.10 vs 0.24 ns a byte here). Returns bytes done.
inline int64_t Fp8RowToFloatF16C(const uint8_t* __restrict src, float* __restrict dst, int64_t n) {
  const __m256i m7f = _mm256_set1_epi16(0x7f), m80 = _mm256_set1_epi16(0x80);
  const __m256i half_nan = _mm256_set1_epi16(0x7e00);
  const __m256 k256 = _mm256_set1_ps(256.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i mag = _mm256_and_si256(b, m7f);
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m80), 8), _mm256_slli_epi16(mag, 7));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, m7f), half_nan));  // S.1111.111
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256));
    _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256));
  }
  return i;
}
#endif

// One head vector of the pool to float. __restrict and a row at a time: the loop vectorises
// without the aliasing checks that one loop writing both K and V buffers needed.
template <typename KV, int64_t kD>
inline void ToFloatRow(const KV* __restrict src, float* __restrict dst, int64_t head_dim) {
  const int64_t D = kD > 0 ? kD : head_dim;
  int64_t start = 0;
#ifdef JAXSERVE_F16C
  if constexpr (std::is_same_v<KV, Fp8E4M3FN>)
    start = Fp8RowToFloatF16C(reinterpret_cast<const uint8_t*>(src), dst, D);
#endif
#pragma omp simd
  for (int64_t d = start; d < D; ++d) dst[d] = ToFloat(src[d]);
}

struct WorkItem {
  int32_t seq, row_begin, row_end;
};

// Q: the element type of q and the output (float, bfloat16 bits); KV: the pool's.
template <typename Q, typename KV>
struct Problem {
  const Q* q;
  const KV* kv;
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu;
  Q* out;
  int64_t heads, kv_heads, group, head_dim, page_size, table_width, num_pages;
  float scale;
  int32_t window;  // 0: none
  float soft_cap;  // 0: none
};

// One work item: rows [row_begin, row_end) of one sequence, every head. Its pages are read once,
// in order (a token's K and V of all heads are one contiguous run), with an online softmax per
// query vector, one page at a time. kD is the head size when known at compile time (else 0).
template <typename Q, typename KV, int64_t kD>
void RunItem(const Problem<Q, KV>& p, const WorkItem& w) {
  const int64_t D = kD > 0 ? kD : p.head_dim, G = p.group, H = p.heads, PS = p.page_size;
  const int64_t nrows = w.row_end - w.row_begin;
  const int64_t nq = nrows * H;  // query vectors, row-major over (row, head)
  const int64_t q_len = p.cu[w.seq + 1] - p.cu[w.seq];
  const int64_t kv_len = p.kv_lens[w.seq];
  const int32_t* table = p.tables + w.seq * p.table_width;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // Per row: its KV position (the last key it sees) and the first key of its window.
  int64_t first[kRowTile], last[kRowTile];
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  for (int64_t r = 0; r < nrows; ++r) {
    last[r] = kv_len - q_len + (w.row_begin + r - p.cu[w.seq]);
    first[r] = p.window > 0 ? std::max<int64_t>(0, last[r] - p.window + 1) : 0;
    lo = std::min(lo, first[r]);
    hi = std::max(hi, last[r]);
  }
  hi = std::min(hi, p.table_width * PS - 1);  // a malformed length never reads past the table row

  thread_local std::vector<float> q, acc, m, l, s, kbuf, vbuf;
  q.resize(nq * D);
  acc.assign(nq * D, 0.0f);
  m.assign(nq, kNegInf);
  l.assign(nq, 0.0f);
  s.resize(PS);
  for (int64_t i = 0; i < nq; ++i) {
    const Q* src = p.q + (w.row_begin * H + i) * D;
    for (int64_t d = 0; d < D; ++d) q[i * D + d] = ToFloat(src[d]) * p.scale;
  }
  if constexpr (!std::is_same_v<KV, float>) {  // other pools are converted a page and head at a time
    kbuf.resize(PS * D);
    vbuf.resize(PS * D);
  }
  const int64_t kv_stride = 2 * p.kv_heads * D;  // between consecutive tokens of a page

  for (int64_t page_idx = lo / PS; page_idx * PS <= hi; ++page_idx) {
    const int64_t base = page_idx * PS;
    const int64_t n = std::min<int64_t>(PS, hi + 1 - base);
    const int64_t page_id = table[page_idx];
    if (page_id < 0 || page_id >= p.num_pages) continue;  // never read outside the pool
    const KV* page = p.kv + page_id * PS * kv_stride;
    for (int64_t kh = 0; kh < p.kv_heads; ++kh) {
      const float* k;
      const float* v;
      int64_t stride;
      if constexpr (std::is_same_v<KV, float>) {
        k = page + 2 * kh * D;
        v = k + D;
        stride = kv_stride;
      } else {
        for (int64_t j = 0; j < n; ++j) {
          ToFloatRow<KV, kD>(page + j * kv_stride + 2 * kh * D, kbuf.data() + j * D, D);
          ToFloatRow<KV, kD>(page + j * kv_stride + (2 * kh + 1) * D, vbuf.data() + j * D, D);
        }
        k = kbuf.data();
        v = vbuf.data();
        stride = D;
      }
      for (int64_t r = 0; r < nrows; ++r) {
        // Keys this row sees in this page: [j0, j1).
        const int64_t j0 = std::max<int64_t>(0, first[r] - base);
        const int64_t j1 = std::min<int64_t>(n, last[r] + 1 - base);
        if (j0 >= j1) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = r * H + kh * G + g;
          const float* qi = q.data() + i * D;
          float page_max = kNegInf;
          for (int64_t j = j0; j < j1; ++j) {
            const float* kj = k + j * stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
            if (p.soft_cap > 0.0f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
            s[j] = dot;
            page_max = std::max(page_max, dot);
          }
          const float m_new = std::max(m[i], page_max);
          const float alpha = std::exp(m[i] - m_new);  // 0 while nothing was seen (m = -inf)
          float* ai = acc.data() + i * D;
          if (alpha != 1.0f)
            for (int64_t d = 0; d < D; ++d) ai[d] *= alpha;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = j0; j < j1; ++j) {
            s[j] = ExpNonPositive(s[j] - m_new);
            sum += s[j];
          }
          for (int64_t j = j0; j < j1; ++j) {
            const float pj = s[j];
            const float* vj = v + j * stride;
            for (int64_t d = 0; d < D; ++d) ai[d] += pj * vj[d];
          }
          l[i] = l[i] * alpha + sum;
          m[i] = m_new;
        }
      }
    }
  }

  for (int64_t i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    Q* dst = p.out + (w.row_begin * H + i) * D;
    for (int64_t d = 0; d < D; ++d) FromFloat(acc[i * D + d] * inv, dst + d);
  }
}

template <typename Q, typename KV>
void RunItem(const Problem<Q, KV>& p, const WorkItem& w) {
  switch (p.head_dim) {  // the common head sizes get fully unrolled inner loops
    case 64: return RunItem<Q, KV, 64>(p, w);
    case 128: return RunItem<Q, KV, 128>(p, w);
    default: return RunItem<Q, KV, 0>(p, w);
  }
}

// Work items of the step, and the counters that hand them out. Shared with the pool's tasks by
// shared_ptr: a task that starts after the call returned finds nothing left and touches nothing.
template <typename Q, typename KV>
struct Job {
  Problem<Q, KV> problem;
  std::vector<WorkItem> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      RunItem(problem, items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType QDT, typename Q, ffi::DataType KVDT, typename KV>
ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_tables,
                     ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                     int32_t sliding_window, float soft_cap, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions();
  const auto kd = kv.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || page_tables.dimensions().size() != 2 || kd[3] != qd[2] ||
      kd[2] < 2 || kd[2] % 2 != 0 || qd[1] % (kd[2] / 2) != 0)
    return ffi::Error::InvalidArgument(
        "ragged paged attention: q must be [T, H, D] and the pool [N, page, 2*KVH, D] with KVH dividing H");
  if (q.element_type() != QDT || out->element_type() != QDT || kv.element_type() != KVDT)
    return ffi::Error::InvalidArgument("ragged paged attention: q, the pool or the output has not this target's dtype");
  auto job = std::make_shared<Job<Q, KV>>();
  Problem<Q, KV>& p = job->problem;
  p.q = reinterpret_cast<const Q*>(q.untyped_data());
  p.kv = reinterpret_cast<const KV*>(kv.untyped_data());
  p.kv_lens = kv_lens.typed_data();
  p.tables = page_tables.typed_data();
  p.cu = cu_q_lens.typed_data();
  p.out = reinterpret_cast<Q*>(out->untyped_data());
  p.heads = qd[1];
  p.head_dim = qd[2];
  p.page_size = kd[1];
  p.kv_heads = kd[2] / 2;
  p.num_pages = kd[0];
  p.group = p.heads / p.kv_heads;
  p.table_width = page_tables.dimensions()[1];
  p.scale = sm_scale;
  p.window = sliding_window;
  p.soft_cap = soft_cap;
  const int64_t T_rows = qd[0];
  const int64_t S = kv_lens.dimensions()[0];
  const int64_t real = std::min<int64_t>(num_seqs.typed_data()[0], S);

  std::memset(out->untyped_data(), 0, T_rows * p.heads * p.head_dim * sizeof(Q));
  for (int64_t s = 0; s < real; ++s) {
    const int64_t begin = std::max<int64_t>(0, p.cu[s]), end = std::min<int64_t>(p.cu[s + 1], T_rows);
    if (p.kv_lens[s] <= 0) continue;
    for (int64_t r = begin; r < end; r += kRowTile)
      job->items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(r),
                            static_cast<int32_t>(std::min(r + kRowTile, end))});
  }
  const int64_t total = static_cast<int64_t>(job->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Drain(); });
  job->Drain();
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

#define JAXSERVE_BIND                                        \
  ffi::Ffi::Bind()                                           \
      .Ctx<ffi::ThreadPool>()                                \
      .Arg<ffi::AnyBuffer>()                                 \
      .Arg<ffi::AnyBuffer>()                                 \
      .Arg<ffi::Buffer<ffi::S32>>()                          \
      .Arg<ffi::Buffer<ffi::S32>>()                          \
      .Arg<ffi::Buffer<ffi::S32>>()                          \
      .Arg<ffi::Buffer<ffi::S32>>()                          \
      .Attr<float>("sm_scale")                               \
      .Attr<int32_t>("sliding_window")                       \
      .Attr<float>("soft_cap")                               \
      .Ret<ffi::AnyBuffer>()

// One target per (q dtype, pool dtype); bfloat16 travels as its bits (uint16_t).
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionF32, (Attention<ffi::F32, float, ffi::F32, float>),
                              JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionBF16, (Attention<ffi::BF16, uint16_t, ffi::BF16, uint16_t>),
                              JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionF32S8, (Attention<ffi::F32, float, ffi::S8, int8_t>),
                              JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionBF16S8, (Attention<ffi::BF16, uint16_t, ffi::S8, int8_t>),
                              JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionF32F8E4M3FN,
                              (Attention<ffi::F32, float, ffi::F8E4M3FN, Fp8E4M3FN>), JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionBF16F8E4M3FN,
                              (Attention<ffi::BF16, uint16_t, ffi::F8E4M3FN, Fp8E4M3FN>), JAXSERVE_BIND);
// e4m3 pools kept as their bytes (uint8: XLA's CPU backend has no fp8 arithmetic, see
// jaxserve.attention.FP8_BITS), and bfloat16 pools under float32 q (--kv-cache-dtype bfloat16).
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionF32U8E4M3FN, (Attention<ffi::F32, float, ffi::U8, Fp8E4M3FN>),
                              JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionBF16U8E4M3FN,
                              (Attention<ffi::BF16, uint16_t, ffi::U8, Fp8E4M3FN>), JAXSERVE_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionF32BF16, (Attention<ffi::F32, float, ffi::BF16, uint16_t>),
                              JAXSERVE_BIND);
