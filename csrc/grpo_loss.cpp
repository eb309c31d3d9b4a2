// Fused GRPO loss (the math of flowgrpo/ops/reference.py), CPU kernel and operator registration.
//
// Operators (namespace flowgrpo):
//   grpo_loss_fwd(prev_sample, mean, mean_old, std, logp_old, advantages, weights, mean_ref?,
//                 kl_sigma?, clip_range, beta, guard) -> (loss, logp, ratio, kl, coef)
//   grpo_loss_bwd(grad_loss, prev_sample, mean, mean_old?, mean_ref?, coef) -> grad_mean
//
// The forward pass reads every latent element once (x', mu and, when needed, mu_old / mu_ref) and
// reduces three sums per row; the backward pass reads them once more and writes dL/dmu. Nothing of
// size N x D is allocated besides the gradient. Work items are (row, chunk of kChunk elements), so
// a handful of rows still spreads over all threads; chunk partial sums are combined in a fixed
// order, which makes the result independent of the thread count.
//
// Inputs may be float32, bfloat16, float16 (accumulated in float32) or float64 (accumulated in
// float64, for gradcheck). The per-row outputs and the loss are float32 (float64 for float64 inputs).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "grpo_loss.h"
#include "grpo_loss_ops.h"

namespace flowgrpo {
namespace {

constexpr int64_t kChunk = 8192;  // elements per work item
constexpr int64_t kSub = 512;     // inner block: short partial sums; staging size for bf16/fp16

int64_t num_chunks(int64_t D) { return (D + kChunk - 1) / kChunk; }

// float16 <-> float32 conversion: F16C instructions where the build enables them (the "avx2"
// build, see flowgrpo/ops/build.py), else ATen's portable conversion.
template <typename src_t, typename dst_t>
inline void convert_block(const src_t* src, dst_t* dst, int64_t n) {
#if defined(__F16C__) && defined(__AVX__)
  if constexpr (std::is_same_v<src_t, c10::Half> && std::is_same_v<dst_t, float>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  } else if constexpr (std::is_same_v<src_t, float> && std::is_same_v<dst_t, c10::Half>) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    }
    for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
    return;
  }
#endif
  at::vec::convert(src, dst, n);
}

// A view of a latent row as acc_t: direct for float/double, staged through a small buffer for
// bfloat16/float16 (converted with ATen's vectorised convert).
template <typename scalar_t>
struct Stage {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kDirect = std::is_same_v<scalar_t, acc_t>;
  alignas(64) acc_t buf[kDirect ? 1 : kSub];
  const acc_t* get(const scalar_t* p, int64_t n) {
    if constexpr (kDirect) {
      return p;
    } else {
      convert_block(p, buf, n);
      return buf;
    }
  }
};

// The element loops are plain loops over restrict pointers that the compiler vectorises
// (`omp simd` licenses the reassociation of the reductions; the lane order is fixed at compile
// time, so results stay deterministic).
#if defined(_OPENMP)
#define FLOWGRPO_SIMD_REDUCE _Pragma("omp simd reduction(+ : a0, a1, a2)")
#define FLOWGRPO_SIMD _Pragma("omp simd")
#else
#define FLOWGRPO_SIMD_REDUCE
#define FLOWGRPO_SIMD
#endif

// Accumulate the three row sums over n contiguous acc_t elements.
template <typename acc_t, bool GUARD, bool KL>
inline void sums_block(
    const acc_t* __restrict__ x, const acc_t* __restrict__ mu, const acc_t* __restrict__ mo,
    const acc_t* __restrict__ mr, int64_t n, acc_t inv_s, acc_t& s0, acc_t& s1, acc_t& s2) {
  acc_t a0 = 0, a1 = 0, a2 = 0;
  FLOWGRPO_SIMD_REDUCE
  for (int64_t i = 0; i < n; ++i) {
    const acc_t m = mu[i];
    const acc_t z = (x[i] - m) * inv_s;
    a0 += z * z;
    if constexpr (GUARD) {
      const acc_t d = m - mo[i];
      a1 += d * d;
    }
    if constexpr (KL) {
      const acc_t d = m - mr[i];
      a2 += d * d;
    }
  }
  s0 += a0;
  s1 += a1;
  s2 += a2;
}

// g = c_lp (x - mu) + c_mo (mu - mu_old) + c_kl (mu - mu_ref) over n contiguous acc_t elements.
template <typename acc_t, bool GUARD, bool KL>
inline void grad_block(
    const acc_t* __restrict__ x, const acc_t* __restrict__ mu, const acc_t* __restrict__ mo,
    const acc_t* __restrict__ mr, int64_t n, acc_t c_lp, acc_t c_mo, acc_t c_kl,
    acc_t* __restrict__ g) {
  FLOWGRPO_SIMD
  for (int64_t i = 0; i < n; ++i) {
    const acc_t m = mu[i];
    acc_t v = c_lp * (x[i] - m);
    if constexpr (GUARD) v += c_mo * (m - mo[i]);
    if constexpr (KL) v += c_kl * (m - mr[i]);
    g[i] = v;
  }
}

template <typename scalar_t, bool GUARD, bool KL>
void fwd_partials(
    const scalar_t* x, const scalar_t* mu, const scalar_t* mo, const scalar_t* mr,
    const at::opmath_type<scalar_t>* inv_s, int64_t N, int64_t D,
    at::opmath_type<scalar_t>* part) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = num_chunks(D);
  at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
    Stage<scalar_t> sx, smu, smo, smr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / C;
      const int64_t off = (item % C) * kChunk;
      const int64_t len = std::min(kChunk, D - off);
      acc_t t0 = 0, t1 = 0, t2 = 0;
      // sub-blocks of kSub elements: short fixed-order partial sums (accuracy) and, for
      // bfloat16/float16, the staging size
      for (int64_t j = 0; j < len; j += kSub) {
        const int64_t n = std::min(kSub, len - j);
        const int64_t b = row * D + off + j;
        sums_block<acc_t, GUARD, KL>(
            sx.get(x + b, n), smu.get(mu + b, n), GUARD ? smo.get(mo + b, n) : nullptr,
            KL ? smr.get(mr + b, n) : nullptr, n, inv_s[row], t0, t1, t2);
      }
      acc_t* out = part + item * 3;
      out[0] = t0;
      out[1] = t1;
      out[2] = t2;
    }
  });
}

template <typename scalar_t, bool GUARD, bool KL>
void bwd_kernel(
    const scalar_t* x, const scalar_t* mu, const scalar_t* mo, const scalar_t* mr,
    const at::opmath_type<scalar_t>* coef, at::opmath_type<scalar_t> gl, int64_t N, int64_t D,
    scalar_t* g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = num_chunks(D);
  at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
    Stage<scalar_t> sx, smu, smo, smr;
    alignas(64) acc_t obuf[Stage<scalar_t>::kDirect ? 1 : kSub];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / C;
      const int64_t off = (item % C) * kChunk;
      const int64_t len = std::min(kChunk, D - off);
      const acc_t c_lp = gl * coef[row * kCoefCols + 0];
      const acc_t c_mo = gl * coef[row * kCoefCols + 1];
      const acc_t c_kl = gl * coef[row * kCoefCols + 2];
      if constexpr (Stage<scalar_t>::kDirect) {
        const int64_t b = row * D + off;
        grad_block<acc_t, GUARD, KL>(x + b, mu + b, GUARD ? mo + b : nullptr,
                                     KL ? mr + b : nullptr, len, c_lp, c_mo, c_kl, g + b);
      } else {
        for (int64_t j = 0; j < len; j += kSub) {
          const int64_t n = std::min(kSub, len - j);
          const int64_t b = row * D + off + j;
          grad_block<acc_t, GUARD, KL>(
              sx.get(x + b, n), smu.get(mu + b, n), GUARD ? smo.get(mo + b, n) : nullptr,
              KL ? smr.get(mr + b, n) : nullptr, n, c_lp, c_mo, c_kl, obuf);
          convert_block(obuf, g + b, n);
        }
      }
    }
  });
}

// The gradient dL/dmu is the one N x D buffer the op allocates. Fresh multi-megabyte buffers are
// mmapped, and first-touch page faults (one per 4 KiB page) can cost more than the kernel itself;
// on Linux, large gradients are therefore allocated 2 MiB-aligned and advised for transparent
// huge pages (a no-op where THP is off). FLOWGRPO_HUGEPAGES=0 restores the plain allocation.
at::Tensor empty_grad_like(const at::Tensor& mean) {
#if defined(__linux__)
  static const bool enabled = [] {
    const char* e = std::getenv("FLOWGRPO_HUGEPAGES");
    return !(e != nullptr && std::string(e) == "0");
  }();
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t nbytes = static_cast<size_t>(mean.numel()) * mean.element_size();
  if (enabled && nbytes >= 2 * kHuge) {
    const size_t len = (nbytes + kHuge - 1) / kHuge * kHuge;
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, len) == 0) {
      (void)madvise(p, len, MADV_HUGEPAGE);  // best effort
      return at::from_blob(p, mean.sizes(), [](void* q) { std::free(q); },
                           mean.options().memory_format(at::MemoryFormat::Contiguous));
    }
  }
#endif
  return at::empty_like(mean, at::MemoryFormat::Contiguous);
}

void check_latent(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.sizes() == like.sizes(), "grpo_loss: ", name, " has shape ", t.sizes(),
              ", expected ", like.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "grpo_loss: ", name, " has dtype ",
              t.scalar_type(), ", expected ", like.scalar_type(), " (same as prev_sample)");
  TORCH_CHECK(t.device() == like.device(), "grpo_loss: ", name, " is on ", t.device(),
              ", expected ", like.device());
}

at::Tensor row_vector(const at::Tensor& t, int64_t N, at::ScalarType acc, const at::Device& dev,
                      const char* name) {
  TORCH_CHECK(t.device() == dev, "grpo_loss: ", name, " is on ", t.device(), ", expected ", dev);
  TORCH_CHECK(t.numel() == N, "grpo_loss: ", name, " must have N = ", N, " elements, got ",
              t.sizes());
  return t.reshape({N}).to(acc).contiguous();
}

}  // namespace

Prepared prepare_fwd(
    const at::Tensor& prev_sample, const at::Tensor& mean, const at::Tensor& mean_old,
    const at::Tensor& std, const at::Tensor& logp_old, const at::Tensor& advantages,
    const at::Tensor& weights, const std::optional<at::Tensor>& mean_ref,
    const std::optional<at::Tensor>& kl_sigma, double beta, bool guard) {
  Prepared p;
  TORCH_CHECK(prev_sample.dim() >= 1, "grpo_loss: prev_sample must be [N, ...]");
  const auto st = prev_sample.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
              "grpo_loss: unsupported dtype ", st);
  check_latent(mean, prev_sample, "mean");
  if (guard) check_latent(mean_old, prev_sample, "mean_old");
  p.N = prev_sample.size(0);
  p.D = p.N > 0 ? prev_sample.numel() / p.N : 0;
  TORCH_CHECK(p.N > 0 && p.D > 0, "grpo_loss: needs N >= 1 rows of D >= 1 elements");
  p.acc = st == at::kDouble ? at::kDouble : at::kFloat;
  p.use_kl = mean_ref.has_value() && beta != 0.0;
  p.x = prev_sample.reshape({p.N, p.D}).contiguous();
  p.mu = mean.reshape({p.N, p.D}).contiguous();
  if (guard) p.mo = mean_old.reshape({p.N, p.D}).contiguous();
  if (p.use_kl) {
    TORCH_CHECK(kl_sigma.has_value(), "grpo_loss: mean_ref given without kl_sigma");
    check_latent(*mean_ref, prev_sample, "mean_ref");
    p.mr = mean_ref->reshape({p.N, p.D}).contiguous();
    p.ks = row_vector(*kl_sigma, p.N, p.acc, prev_sample.device(), "kl_sigma");
  }
  p.s = row_vector(std, p.N, p.acc, prev_sample.device(), "std");
  p.lpo = row_vector(logp_old, p.N, p.acc, prev_sample.device(), "logp_old");
  p.adv = row_vector(advantages, p.N, p.acc, prev_sample.device(), "advantages");
  p.w = row_vector(weights, p.N, p.acc, prev_sample.device(), "weights");
  return p;
}

std::pair<int64_t, int64_t> check_bwd(
    const at::Tensor& grad_loss, const at::Tensor& prev_sample, const at::Tensor& mean,
    const std::optional<at::Tensor>& mean_old, const std::optional<at::Tensor>& mean_ref,
    const at::Tensor& coef) {
  TORCH_CHECK(mean.dim() >= 1, "grpo_loss_bwd: mean must be [N, ...]");
  check_latent(prev_sample, mean, "prev_sample");
  if (mean_old.has_value()) check_latent(*mean_old, mean, "mean_old");
  if (mean_ref.has_value()) check_latent(*mean_ref, mean, "mean_ref");
  TORCH_CHECK(grad_loss.numel() == 1, "grpo_loss_bwd: grad_loss must be a scalar");
  const int64_t N = mean.size(0);
  const int64_t D = N > 0 ? mean.numel() / N : 0;
  TORCH_CHECK(coef.numel() == N * kCoefCols, "grpo_loss_bwd: coef must be [N, ", kCoefCols, "]");
  TORCH_CHECK(coef.device() == mean.device() && grad_loss.device() == mean.device(),
              "grpo_loss_bwd: coef and grad_loss must be on ", mean.device());
  return {N, D};
}

FwdOutputs alloc_fwd_outputs(const Prepared& p, int64_t chunks) {
  const auto opts = p.x.options().dtype(p.acc);
  return {at::empty({p.N * chunks * 3}, opts), at::empty({}, opts), at::empty({p.N}, opts),
          at::empty({p.N}, opts), at::empty({p.N}, opts), at::empty({p.N, kCoefCols}, opts)};
}

BwdOperands prepare_bwd(
    const at::Tensor& grad_loss, const at::Tensor& prev_sample, const at::Tensor& mean,
    const std::optional<at::Tensor>& mean_old, const std::optional<at::Tensor>& mean_ref,
    const at::Tensor& coef) {
  const auto nd = check_bwd(grad_loss, prev_sample, mean, mean_old, mean_ref, coef);
  BwdOperands b;
  b.N = nd.first;
  b.D = nd.second;
  if (b.N == 0 || b.D == 0) return b;
  const auto acc = mean.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  b.x = prev_sample.reshape({b.N, b.D}).contiguous();
  b.mu = mean.reshape({b.N, b.D}).contiguous();
  b.mo = mean_old.has_value() ? mean_old->reshape({b.N, b.D}).contiguous() : at::Tensor();
  b.mr = mean_ref.has_value() ? mean_ref->reshape({b.N, b.D}).contiguous() : at::Tensor();
  b.coef = coef.to(acc).contiguous();
  b.guard = b.mo.defined();
  b.kl = b.mr.defined();
  return b;
}

namespace {

template <typename acc_t>
void finalize_rows(
    const acc_t* part, int64_t C, const Prepared& p, double clip_range, double beta, bool guard,
    acc_t* loss, acc_t* logp, acc_t* ratio, acc_t* kl, acc_t* coef) {
  const acc_t* s = p.s.data_ptr<acc_t>();
  const acc_t* lpo = p.lpo.data_ptr<acc_t>();
  const acc_t* adv = p.adv.data_ptr<acc_t>();
  const acc_t* w = p.w.data_ptr<acc_t>();
  const acc_t* ks = p.use_kl ? p.ks.data_ptr<acc_t>() : nullptr;
  const acc_t lo = static_cast<acc_t>(1.0 - clip_range);
  const acc_t hi = static_cast<acc_t>(1.0 + clip_range);
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(p.N);
  const acc_t D = static_cast<acc_t>(p.D);
  // fixed-order combination, in double, of per-row terms into the loss
  double pol_sum = 0.0, kl_sum = 0.0;
  for (int64_t row = 0; row < p.N; ++row) {
    const RowResult<acc_t> o = finish_row<acc_t>(part, C, row, D, s, lpo, adv, w, ks, lo, hi, inv_n,
                                                 static_cast<acc_t>(beta), guard, p.use_kl, logp, ratio,
                                                 kl, coef);
    pol_sum += static_cast<double>(o.policy);
    kl_sum += static_cast<double>(o.kl);
  }
  const acc_t pol_mean = static_cast<acc_t>(pol_sum / static_cast<double>(p.N));
  if (p.use_kl) {
    const acc_t kl_mean = static_cast<acc_t>(kl_sum / static_cast<double>(p.N));
    *loss = pol_mean + static_cast<acc_t>(beta) * kl_mean;
  } else {
    *loss = pol_mean;
  }
}

}  // namespace

FwdResult grpo_loss_fwd_cpu(FLOWGRPO_FWD_PARAMS) {
  Prepared p = prepare_fwd(prev_sample, mean, mean_old, std, logp_old, advantages, weights,
                           mean_ref, kl_sigma, beta, guard);
  TORCH_CHECK(p.x.device().is_cpu(), "grpo_loss_fwd_cpu: tensors must be on the CPU");
  const int64_t C = num_chunks(p.D);
  FwdOutputs out = alloc_fwd_outputs(p, C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.x.scalar_type(), "grpo_loss_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor inv_s = p.s.reciprocal();
    const scalar_t* x = p.x.data_ptr<scalar_t>();
    const scalar_t* mu = p.mu.data_ptr<scalar_t>();
    const scalar_t* mo = guard ? p.mo.data_ptr<scalar_t>() : nullptr;
    const scalar_t* mr = p.use_kl ? p.mr.data_ptr<scalar_t>() : nullptr;
    const acc_t* is = inv_s.data_ptr<acc_t>();
    acc_t* pp = out.part.data_ptr<acc_t>();
    dispatch_variants(guard, p.use_kl, [&](auto g, auto k) {
      fwd_partials<scalar_t, decltype(g)::value, decltype(k)::value>(x, mu, mo, mr, is, p.N, p.D, pp);
    });
    finalize_rows<acc_t>(pp, C, p, clip_range, beta, guard, out.loss.data_ptr<acc_t>(),
                         out.logp.data_ptr<acc_t>(), out.ratio.data_ptr<acc_t>(), out.kl.data_ptr<acc_t>(),
                         out.coef.data_ptr<acc_t>());
  });
  return {out.loss, out.logp, out.ratio, out.kl, out.coef};
}

at::Tensor grpo_loss_bwd_cpu(FLOWGRPO_BWD_PARAMS) {
  const BwdOperands b = prepare_bwd(grad_loss, prev_sample, mean, mean_old, mean_ref, coef);
  TORCH_CHECK(mean.device().is_cpu(), "grpo_loss_bwd_cpu: tensors must be on the CPU");
  if (b.N == 0 || b.D == 0) return at::empty_like(mean, at::MemoryFormat::Contiguous);
  at::Tensor grad = empty_grad_like(mean);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, b.mu.scalar_type(), "grpo_loss_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t gl = grad_loss.to(b.coef.scalar_type()).item<acc_t>();
    const BwdPointers<scalar_t> q = bwd_pointers<scalar_t>(b, grad);
    dispatch_variants(b.guard, b.kl, [&](auto g, auto k) {
      bwd_kernel<scalar_t, decltype(g)::value, decltype(k)::value>(q.x, q.mu, q.mo, q.mr, q.coef, gl, b.N, b.D, q.grad);
    });
  });
  return grad;
}

TORCH_LIBRARY(flowgrpo, m) {
  m.def(
      "grpo_loss_fwd(Tensor prev_sample, Tensor mean, Tensor mean_old, Tensor std, "
      "Tensor logp_old, Tensor advantages, Tensor weights, Tensor? mean_ref, Tensor? kl_sigma, "
      "float clip_range, float beta, bool guard) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "grpo_loss_bwd(Tensor grad_loss, Tensor prev_sample, Tensor mean, Tensor? mean_old, "
      "Tensor? mean_ref, Tensor coef) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowgrpo, CPU, m) {
  m.impl("grpo_loss_fwd", &grpo_loss_fwd_cpu);
  m.impl("grpo_loss_bwd", &grpo_loss_bwd_cpu);
}

}  // namespace flowgrpo
