// Fused GRPO loss (clipped ratio surrogate, GRPO-Guard, KL term): per-row scalar math shared by the
// CPU and CUDA kernels.
//
// Every row j is one SDE transition with D latent elements. The element kernels reduce three
// sums per row:
//   ssq = sum_i ((x'_i - mu_i) / s)^2          (Gaussian log-prob, averaged over the D elements)
//   smo = sum_i (mu_i - mu_old_i)^2            (GRPO-Guard normalisation, only when guard)
//   skl = sum_i (mu_i - mu_ref_i)^2            (KL term, only when the KL term is on)
// and grpo_row() turns them into the per-row outputs and the backward coefficients, so that
//   dL/dmu_i = grad_loss * (c_lp * (x'_i - mu_i) + c_mo * (mu_i - mu_old_i) + c_kl * (mu_i - mu_ref_i)).
// The branch logic mirrors the PyTorch reference (flowgrpo/ops/reference.py) exactly, including
// torch.maximum's tie rule (half the gradient to each side) and torch.clamp's backward (zero
// gradient at the bounds themselves).
#pragma once

#include <math.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FLOWGRPO_HD __host__ __device__ __forceinline__
#else
#define FLOWGRPO_HD inline
#endif

namespace flowgrpo {

// Layout of the per-row "coef" tensor saved for backward: [N, kCoefCols].
constexpr int kCoefCols = 3;  // c_lp, c_mo, c_kl (for grad_loss == 1)

template <typename T>
struct RowResult {
  T logp;
  T ratio;
  T kl;
  T policy;  // w_j * max(-A r, -A clip(r)) (not yet divided by N)
  T c_lp;
  T c_mo;
  T c_kl;
};

FLOWGRPO_HD float math_exp(float v) { return expf(v); }
FLOWGRPO_HD double math_exp(double v) { return exp(v); }
FLOWGRPO_HD float math_log(float v) { return logf(v); }
FLOWGRPO_HD double math_log(double v) { return log(v); }

template <typename T>
FLOWGRPO_HD T log_sqrt_2pi() {
  return T(0.91893853320467274178032973640561764);  // 0.5 * log(2 pi)
}

template <typename T>
FLOWGRPO_HD RowResult<T> grpo_row(
    T ssq, T smo, T skl, T D, T s, T logp_old, T adv, T w, T kl_sigma, T lo, T hi, T inv_n,
    T beta, bool guard, bool use_kl) {
  RowResult<T> o;
  // logp = mean_D(-(x' - mu)^2 / (2 s^2)) - log s - log sqrt(2 pi)
  o.logp = -ssq / (T(2) * D) - math_log(s) - log_sqrt_2pi<T>();
  T log_ratio = o.logp - logp_old;
  if (guard) {
    const T mse = smo / D;
    log_ratio = s * log_ratio + mse / (T(2) * s);
  }
  const T r = math_exp(log_ratio);
  o.ratio = r;
  // torch.clamp forward (NaN propagates).
  const T rc = (r < lo) ? lo : ((r > hi) ? hi : r);
  const T u = -adv * r;    // unclipped branch
  const T c = -adv * rc;   // clipped branch
  // torch.maximum: NaN propagates; ties split the gradient in half.
  const T m = (u > c || u != u) ? u : c;
  o.policy = w * m;
  const T gu = (u > c) ? T(1) : ((u == c) ? T(0.5) : T(0));
  const T gc = (c > u) ? T(1) : ((u == c) ? T(0.5) : T(0));
  // torch.clamp's backward passes the gradient strictly inside (lo, hi), not at the bounds
  const T inside = (r > lo && r < hi) ? T(1) : T(0);
  const T dm_dr = -adv * (gu + gc * inside);
  const T g_lr = w * inv_n * dm_dr * r;  // dL/dlog_ratio for grad_loss = 1
  if (guard) {
    // log r^ = s (logp - logp_old) + mse / (2 s):
    // dlog r^/dmu_i = s * (x'_i - mu_i) / (s^2 D) + (mu_i - mu_old_i) / (s D)
    o.c_lp = g_lr / (s * D);
    o.c_mo = g_lr / (s * D);
  } else {
    o.c_lp = g_lr / (s * s * D);
    o.c_mo = T(0);
  }
  if (use_kl) {
    o.kl = skl / D / (T(2) * kl_sigma * kl_sigma);
    o.c_kl = beta * inv_n / (D * kl_sigma * kl_sigma);
  } else {
    o.kl = T(0);
    o.c_kl = T(0);
  }
  return o;
}

// Sums row ``row``'s C partial triples (part[(row * C + c) * 3 + k]), evaluates grpo_row, stores the
// per-row outputs (logp, ratio, kl, backward coefficients) and returns the row's result, whose
// ``policy`` and ``kl`` the caller adds into the loss in its own (fixed) order.
template <typename T>
FLOWGRPO_HD RowResult<T> finish_row(
    const T* part, int64_t C, int64_t row, T D, const T* s, const T* lpo, const T* adv, const T* w,
    const T* ks, T lo, T hi, T inv_n, T beta, bool guard, bool use_kl, T* logp, T* ratio, T* kl,
    T* coef) {
  T t0 = 0, t1 = 0, t2 = 0;
  for (int64_t c = 0; c < C; ++c) {
    t0 += part[(row * C + c) * 3 + 0];
    t1 += part[(row * C + c) * 3 + 1];
    t2 += part[(row * C + c) * 3 + 2];
  }
  const RowResult<T> o = grpo_row<T>(t0, t1, t2, D, s[row], lpo[row], adv[row], w[row],
                                     use_kl ? ks[row] : T(1), lo, hi, inv_n, beta, guard, use_kl);
  logp[row] = o.logp;
  ratio[row] = o.ratio;
  kl[row] = o.kl;
  coef[row * kCoefCols + 0] = o.c_lp;
  coef[row * kCoefCols + 1] = o.c_mo;
  coef[row * kCoefCols + 2] = o.c_kl;
  return o;
}

}  // namespace flowgrpo
