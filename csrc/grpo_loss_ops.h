// Fused GRPO loss: host-side declarations shared by grpo_loss.cpp and grpo_loss_cuda.cu.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <type_traits>

namespace flowgrpo {

// The parameter lists of the two operators (schema in grpo_loss.cpp), written once for the CPU and
// CUDA implementations.
#define FLOWGRPO_FWD_PARAMS                                                                        \
  const at::Tensor &prev_sample, const at::Tensor &mean, const at::Tensor &mean_old,               \
      const at::Tensor &std, const at::Tensor &logp_old, const at::Tensor &advantages,             \
      const at::Tensor &weights, const std::optional<at::Tensor> &mean_ref,                        \
      const std::optional<at::Tensor> &kl_sigma, double clip_range, double beta, bool guard
#define FLOWGRPO_BWD_PARAMS                                                                        \
  const at::Tensor &grad_loss, const at::Tensor &prev_sample, const at::Tensor &mean,              \
      const std::optional<at::Tensor> &mean_old, const std::optional<at::Tensor> &mean_ref,        \
      const at::Tensor &coef
// (loss, logp, ratio, kl, coef)
using FwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

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

// The forward pass's outputs (and the [N * C * 3] partial sums), allocated in the accumulation dtype.
struct FwdOutputs {
  at::Tensor part, loss, logp, ratio, kl, coef;
};
FwdOutputs alloc_fwd_outputs(const Prepared& p, int64_t chunks);

// Flattened, contiguous operands of grpo_loss_bwd (mo / mr undefined when absent).
struct BwdOperands {
  at::Tensor x, mu, mo, mr, coef;
  int64_t N = 0, D = 0;
  bool guard = false, kl = false;
};
BwdOperands prepare_bwd(
    const at::Tensor& grad_loss, const at::Tensor& prev_sample, const at::Tensor& mean,
    const std::optional<at::Tensor>& mean_old, const std::optional<at::Tensor>& mean_ref,
    const at::Tensor& coef);

// Typed data pointers of BwdOperands and the gradient to write.
template <typename scalar_t>
struct BwdPointers {
  const scalar_t *x, *mu, *mo, *mr;
  const at::opmath_type<scalar_t>* coef;
  scalar_t* grad;
};
template <typename scalar_t>
BwdPointers<scalar_t> bwd_pointers(const BwdOperands& b, at::Tensor& grad) {
  return {b.x.data_ptr<scalar_t>(), b.mu.data_ptr<scalar_t>(), b.guard ? b.mo.data_ptr<scalar_t>() : nullptr,
          b.kl ? b.mr.data_ptr<scalar_t>() : nullptr, b.coef.data_ptr<at::opmath_type<scalar_t>>(),
          grad.data_ptr<scalar_t>()};
}

// Calls fn(std::bool_constant<GUARD>{}, std::bool_constant<KL>{}) for the runtime flags, so each
// kernel is instantiated for the four variants once, in one place.
template <typename Fn>
void dispatch_variants(bool guard, bool kl, Fn&& fn) {
  if (guard && kl) {
    fn(std::true_type{}, std::true_type{});
  } else if (guard) {
    fn(std::true_type{}, std::false_type{});
  } else if (kl) {
    fn(std::false_type{}, std::true_type{});
  } else {
    fn(std::false_type{}, std::false_type{});
  }
}

}  // namespace flowgrpo
