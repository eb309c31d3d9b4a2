// Fused GRPO loss: host-side declarations shared by grpo_loss.cpp and grpo_loss_cuda.cu.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace flowgrpo {

// Checked, flattened and contiguous operands of grpo_loss_fwd.
struct Prepared {
  at::Tensor x, mu, mo, mr;       // [N, D] latent rows (mo only with guard, mr only with KL)
  at::Tensor s, lpo, adv, w, ks;  // [N] per-row scalars in the accumulation dtype
  int64_t N = 0, D = 0;
  at::ScalarType acc = at::kFloat;  // float32, or float64 for float64 inputs
  bool use_kl = false;
};

Prepared prepare_fwd(
    const at::Tensor& prev_sample, const at::Tensor& mean, const at::Tensor& mean_old,
    const at::Tensor& std, const at::Tensor& logp_old, const at::Tensor& advantages,
    const at::Tensor& weights, const std::optional<at::Tensor>& mean_ref,
    const std::optional<at::Tensor>& kl_sigma, double beta, bool guard);

// Checks shared by the backward implementations; returns {N, D}.
std::pair<int64_t, int64_t> check_bwd(
    const at::Tensor& grad_loss, const at::Tensor& prev_sample, const at::Tensor& mean,
    const std::optional<at::Tensor>& mean_old, const std::optional<at::Tensor>& mean_ref,
    const at::Tensor& coef);

}  // namespace flowgrpo
