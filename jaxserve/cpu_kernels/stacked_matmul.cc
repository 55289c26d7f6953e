// x @ w[layer] for float32 weights stacked on a leading layer axis, read where they lie.
//
// Contract (jaxserve.cpu_kernels.stacked.stacked_matmul_reference is the oracle): x f32 [rows, in];
// w f32 [layers, in, out]; layer s32 scalar; y f32 [rows, out] = x @ w[layer].
//
// Why a kernel: the model runs its layers under lax.scan over weights stacked [L, ...], and XLA's
// CPU backend copies each layer's slice of every weight into a fresh buffer before its dot
// (dynamic-slice fusions): at a decode step of a few rows every weight was read twice and written
// once, ~half of a one-row step of the default model (docs/benchmarks.md). Here the dot reads the
// slice in place. Only for small row counts (the model's choice): there the step is a weight
// stream; large prefill chunks keep XLA's dot, which is faster per row and amortises the copy.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kOutChunk = 512;  // outputs per work item: 4 rows of accumulators, 8 KB, stay in L1
// Below this many multiply-adds a call runs on the calling thread alone (waking a helper costs more).
constexpr int64_t kParallelWork = 1 << 18;

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, in, out;
};

constexpr int64_t kRowBlock = 4;
constexpr int64_t kK = 4;  // inputs per pass over the accumulators

// acc[0:NR, 0:n] += x[r0:r0+NR, :] @ W[:, o0:o0+n], k outermost: each weight row segment
// W[k, o0:o0+n] streams contiguously; kK of them are combined per pass, so the accumulators
// (in L1) are loaded and stored once per kK inputs and each weight value serves NR rows.
template <int NR>
void Rows(const Problem& p, int64_t r0, int64_t o0, int64_t n, float (*acc)[kOutChunk]) {
  int64_t k = 0;
  for (; k + kK <= p.in; k += kK) {
    const float* __restrict w0 = p.w + k * p.out + o0;
    const float* __restrict w1 = w0 + p.out;
    const float* __restrict w2 = w1 + p.out;
    const float* __restrict w3 = w2 + p.out;
    float xs[NR][kK];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kK; ++i) xs[r][i] = p.x[(r0 + r) * p.in + k + i];
    for (int64_t j = 0; j < n; ++j) {
      const float a = w0[j], b = w1[j], c = w2[j], d = w3[j];
      for (int r = 0; r < NR; ++r) acc[r][j] += xs[r][0] * a + xs[r][1] * b + xs[r][2] * c + xs[r][3] * d;
    }
  }
  for (; k < p.in; ++k) {
    const float* __restrict wk = p.w + k * p.out + o0;
    for (int r = 0; r < NR; ++r) {
      const float xv = p.x[(r0 + r) * p.in + k];
      for (int64_t j = 0; j < n; ++j) acc[r][j] += xv * wk[j];
    }
  }
}

void Tile(const Problem& p, int64_t o0, int64_t o1) {
  const int64_t n = o1 - o0;
  alignas(64) float acc[kRowBlock][kOutChunk];
  for (int64_t r0 = 0; r0 < p.rows; r0 += kRowBlock) {
    const int64_t nr = std::min(kRowBlock, p.rows - r0);
    for (int64_t r = 0; r < nr; ++r) std::fill(acc[r], acc[r] + n, 0.f);
    switch (nr) {
      case 1: Rows<1>(p, r0, o0, n, acc); break;
      case 2: Rows<2>(p, r0, o0, n, acc); break;
      case 3: Rows<3>(p, r0, o0, n, acc); break;
      default: Rows<4>(p, r0, o0, n, acc); break;
    }
    for (int64_t r = 0; r < nr; ++r) std::copy(acc[r], acc[r] + n, p.y + (r0 + r) * p.out + o0);
  }
}

struct Job {
  Problem p;
  int64_t chunks, width;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  void Drain() {
    for (int64_t i; (i = next.fetch_add(1)) < chunks;) {
      Tile(p, i * width, std::min(p.out, (i + 1) * width));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error StackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("stacked matmul: x [rows, in], w [layers, in, out], y [rows, out]");
  const int64_t rows = xd[0], in = xd[1], out = wd[2], layers = wd[0];
  if (wd[1] != in || yd[0] != rows || yd[1] != out)
    return ffi::Error::InvalidArgument("stacked matmul: shapes disagree");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("stacked matmul: layer out of range");
  if (rows == 0 || out == 0) return ffi::Error::Success();
  auto job = std::make_shared<Job>();
  job->p = Problem{x.typed_data(), w.typed_data() + l * in * out, y->typed_data(), rows, in, out};
  const int64_t workers = rows * in * out >= kParallelWork ? pool.num_threads() : 1;
  // Two work items per thread at least (576 or 1536 outputs over 2 threads in 512-wide items would
  // leave one thread idle half the call), 16-aligned, at most kOutChunk.
  job->width = std::min<int64_t>(kOutChunk, ((out + 2 * workers - 1) / (2 * workers) + 15) / 16 * 16);
  job->chunks = (out + job->width - 1) / job->width;
  const int64_t helpers = std::min<int64_t>(workers, job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Drain(); });
  job->Drain();
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmulF32, StackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
