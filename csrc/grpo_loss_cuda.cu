// Fused GRPO loss (the math of flowgrpo/ops/reference.py), CUDA kernels (split-D two-pass
// reduction, fp32 accumulation).
//
// forward:  kernel 1, grid (chunks, rows): each block reduces the three row sums over one chunk of
//           kChunk elements of one row and writes its partial sums;
//           kernel 2, one block: combines the partials of each row in a fixed order, computes the
//           per-row outputs and backward coefficients (grpo_row, shared with the CPU kernel) and
//           reduces the loss. Deterministic: no atomics.
// backward: grid (chunks, rows): dL/dmu = grad_loss * (c_lp (x' - mu) + c_mo (mu - mu_old)
//           + c_kl (mu - mu_ref)), one read of each operand, one write.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "grpo_loss.h"
#include "grpo_loss_ops.h"

namespace flowgrpo {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 4096;  // elements per block (16 per thread)
constexpr int64_t kMaxGridY = 65535;

int64_t num_chunks(int64_t D) { return (D + kChunk - 1) / kChunk; }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum of three values; the result is valid in thread 0.
template <typename T>
__device__ __forceinline__ void block_sum3(T& a, T& b, T& c) {
  __shared__ T sh[3][kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  c = warp_sum(c);
  if (lane == 0) {
    sh[0][warp] = a;
    sh[1][warp] = b;
    sh[2][warp] = c;
  }
  __syncthreads();
  if (warp == 0) {
    const bool ok = lane < (kThreads / 32);
    a = ok ? sh[0][lane] : T(0);
    b = ok ? sh[1][lane] : T(0);
    c = ok ? sh[2][lane] : T(0);
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
  }
  __syncthreads();
}

template <typename scalar_t, bool GUARD, bool KL>
__global__ void __launch_bounds__(kThreads) fwd_partials_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ mu,
    const scalar_t* __restrict__ mo, const scalar_t* __restrict__ mr,
    const at::opmath_type<scalar_t>* __restrict__ sd, int64_t N, int64_t D, int64_t C,
    at::opmath_type<scalar_t>* __restrict__ part) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t c = blockIdx.x;
  const int64_t off = c * kChunk;
  const int64_t end = (off + kChunk < D) ? off + kChunk : D;
  for (int64_t row = blockIdx.y; row < N; row += gridDim.y) {
    const acc_t inv_s = acc_t(1) / sd[row];
    const int64_t base = row * D;
    acc_t a0 = 0, a1 = 0, a2 = 0;
    for (int64_t i = off + threadIdx.x; i < end; i += kThreads) {
      const acc_t m = static_cast<acc_t>(mu[base + i]);
      const acc_t z = (static_cast<acc_t>(x[base + i]) - m) * inv_s;
      a0 += z * z;
      if (GUARD) {
        const acc_t d = m - static_cast<acc_t>(mo[base + i]);
        a1 += d * d;
      }
      if (KL) {
        const acc_t d = m - static_cast<acc_t>(mr[base + i]);
        a2 += d * d;
      }
    }
    block_sum3(a0, a1, a2);
    if (threadIdx.x == 0) {
      acc_t* out = part + (row * C + c) * 3;
      out[0] = a0;
      out[1] = a1;
      out[2] = a2;
    }
  }
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) finalize_kernel(
    const acc_t* __restrict__ part, int64_t C, int64_t N, int64_t D,
    const acc_t* __restrict__ s, const acc_t* __restrict__ lpo, const acc_t* __restrict__ adv,
    const acc_t* __restrict__ w, const acc_t* __restrict__ ks, acc_t lo, acc_t hi, acc_t beta,
    bool guard, bool use_kl, acc_t* __restrict__ loss, acc_t* __restrict__ logp,
    acc_t* __restrict__ ratio, acc_t* __restrict__ kl, acc_t* __restrict__ coef) {
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(N);
  double pol_sum = 0.0, kl_sum = 0.0, unused = 0.0;
  for (int64_t row = threadIdx.x; row < N; row += kThreads) {
    const RowResult<acc_t> o = finish_row<acc_t>(part, C, row, static_cast<acc_t>(D), s, lpo, adv, w, ks, lo,
                                                 hi, inv_n, beta, guard, use_kl, logp, ratio, kl, coef);
    pol_sum += static_cast<double>(o.policy);
    kl_sum += static_cast<double>(o.kl);
  }
  block_sum3(pol_sum, kl_sum, unused);
  if (threadIdx.x == 0) {
    const acc_t pol_mean = static_cast<acc_t>(pol_sum / static_cast<double>(N));
    const acc_t kl_mean = static_cast<acc_t>(kl_sum / static_cast<double>(N));
    *loss = use_kl ? pol_mean + beta * kl_mean : pol_mean;
  }
}

template <typename scalar_t, bool GUARD, bool KL>
__global__ void __launch_bounds__(kThreads) bwd_kernel(
    const at::opmath_type<scalar_t>* __restrict__ grad_loss, const scalar_t* __restrict__ x,
    const scalar_t* __restrict__ mu, const scalar_t* __restrict__ mo,
    const scalar_t* __restrict__ mr, const at::opmath_type<scalar_t>* __restrict__ coef,
    int64_t N, int64_t D, scalar_t* __restrict__ g) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t gl = *grad_loss;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = (off + kChunk < D) ? off + kChunk : D;
  for (int64_t row = blockIdx.y; row < N; row += gridDim.y) {
    const acc_t c_lp = gl * coef[row * kCoefCols + 0];
    const acc_t c_mo = gl * coef[row * kCoefCols + 1];
    const acc_t c_kl = gl * coef[row * kCoefCols + 2];
    const int64_t base = row * D;
    for (int64_t i = off + threadIdx.x; i < end; i += kThreads) {
      const acc_t m = static_cast<acc_t>(mu[base + i]);
      acc_t v = c_lp * (static_cast<acc_t>(x[base + i]) - m);
      if (GUARD) v += c_mo * (m - static_cast<acc_t>(mo[base + i]));
      if (KL) v += c_kl * (m - static_cast<acc_t>(mr[base + i]));
      g[base + i] = static_cast<scalar_t>(v);
    }
  }
}

dim3 row_chunk_grid(int64_t N, int64_t D) {
  return dim3(static_cast<unsigned>(num_chunks(D)),
              static_cast<unsigned>(std::min<int64_t>(N, kMaxGridY)));
}

}  // namespace

FwdResult grpo_loss_fwd_cuda(FLOWGRPO_FWD_PARAMS) {
  const c10::cuda::CUDAGuard device_guard(prev_sample.device());
  Prepared p = prepare_fwd(prev_sample, mean, mean_old, std, logp_old, advantages, weights,
                           mean_ref, kl_sigma, beta, guard);
  TORCH_CHECK(p.x.is_cuda(), "grpo_loss_fwd_cuda: tensors must be on a CUDA device");
  TORCH_CHECK(num_chunks(p.D) <= 0x7fffffff, "grpo_loss: D too large");
  const int64_t C = num_chunks(p.D);
  FwdOutputs out = alloc_fwd_outputs(p, C);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid = row_chunk_grid(p.N, p.D);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.x.scalar_type(), "grpo_loss_fwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = p.x.data_ptr<scalar_t>();
    const scalar_t* mu = p.mu.data_ptr<scalar_t>();
    const scalar_t* mo = guard ? p.mo.data_ptr<scalar_t>() : nullptr;
    const scalar_t* mr = p.use_kl ? p.mr.data_ptr<scalar_t>() : nullptr;
    const acc_t* s = p.s.data_ptr<acc_t>();
    acc_t* pp = out.part.data_ptr<acc_t>();
    dispatch_variants(guard, p.use_kl, [&](auto g, auto k) {
      fwd_partials_kernel<scalar_t, decltype(g)::value, decltype(k)::value>
          <<<grid, kThreads, 0, stream>>>(x, mu, mo, mr, s, p.N, p.D, C, pp);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        pp, C, p.N, p.D, s, p.lpo.data_ptr<acc_t>(), p.adv.data_ptr<acc_t>(),
        p.w.data_ptr<acc_t>(), p.use_kl ? p.ks.data_ptr<acc_t>() : nullptr,
        static_cast<acc_t>(1.0 - clip_range), static_cast<acc_t>(1.0 + clip_range),
        static_cast<acc_t>(beta), guard, p.use_kl, out.loss.data_ptr<acc_t>(),
        out.logp.data_ptr<acc_t>(), out.ratio.data_ptr<acc_t>(), out.kl.data_ptr<acc_t>(),
        out.coef.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out.loss, out.logp, out.ratio, out.kl, out.coef};
}

at::Tensor grpo_loss_bwd_cuda(FLOWGRPO_BWD_PARAMS) {
  const c10::cuda::CUDAGuard device_guard(mean.device());
  const BwdOperands b = prepare_bwd(grad_loss, prev_sample, mean, mean_old, mean_ref, coef);
  TORCH_CHECK(mean.is_cuda(), "grpo_loss_bwd_cuda: tensors must be on a CUDA device");
  at::Tensor grad = at::empty_like(mean, at::MemoryFormat::Contiguous);
  if (b.N == 0 || b.D == 0) return grad;
  at::Tensor gl = grad_loss.reshape({}).to(b.coef.scalar_type()).contiguous();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid = row_chunk_grid(b.N, b.D);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, b.mu.scalar_type(), "grpo_loss_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* pgl = gl.data_ptr<acc_t>();
    const BwdPointers<scalar_t> q = bwd_pointers<scalar_t>(b, grad);
    dispatch_variants(b.guard, b.kl, [&](auto g, auto k) {
      bwd_kernel<scalar_t, decltype(g)::value, decltype(k)::value>
          <<<grid, kThreads, 0, stream>>>(pgl, q.x, q.mu, q.mo, q.mr, q.coef, b.N, b.D, q.grad);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

TORCH_LIBRARY_IMPL(flowgrpo, CUDA, m) {
  m.impl("grpo_loss_fwd", &grpo_loss_fwd_cuda);
  m.impl("grpo_loss_bwd", &grpo_loss_bwd_cuda);
}

}  // namespace flowgrpo
