// Python bindings of the fused dense ops: argument checks and output allocation here, the cuBLASLt
// calls in fused_dense_cuda.cu. Inputs are 2-D, contiguous, float16 or bfloat16, on one CUDA device;
// tpflash/kernels/fused_dense.py flattens leading dimensions and picks the fallback otherwise.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "fused_dense.h"

namespace tpflash {
namespace {

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but x is on ", like.device());
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name, " has dtype ",
              t.scalar_type(), ": only float16 and bfloat16 are supported");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(), " but x has ",
              like.scalar_type());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_vector(const at::Tensor& t, const char* name, int64_t size, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size, name, " must have shape [", size, "], got ", t.sizes());
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(), " but x has ",
              like.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// cuBLASLt reads the GELU input with a leading dimension that must be a multiple of 8.
void check_gelu_width(int64_t width, const char* name) {
  TORCH_CHECK(width % 8 == 0, name, "=", width, " must be a multiple of 8 for the cuBLASLt GELU epilogue");
}

}  // namespace

// (out, pre_act): out = gelu_tanh(x @ weight^T + bias), pre_act = x @ weight^T + bias.
// x [M, K], weight [N, K], bias [N] -> [M, N] each.
std::vector<at::Tensor> linear_gelu_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                            int64_t heuristic) {
  check_matrix(x, "x", x);
  check_matrix(weight, "weight", x);
  TORCH_CHECK(weight.size(1) == x.size(1), "weight.shape[1]=", weight.size(1), " must equal x.shape[1]=", x.size(1));
  check_vector(bias, "bias", weight.size(0), x);
  check_gelu_width(weight.size(0), "out_features");
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  at::Tensor pre_act = at::empty_like(out);
  gelu_forward_cuda(x, weight, bias, out, pre_act, heuristic);
  return {out, pre_act};
}

// (d_weight,) or (d_weight, d_bias): d_weight = d_out^T @ x [N, K], d_bias = d_out.sum(0) [N].
// x [M, K], d_out [M, N].
std::vector<at::Tensor> linear_weight_grad(const at::Tensor& x, const at::Tensor& d_out, bool with_bias_grad) {
  check_matrix(x, "x", x);
  check_matrix(d_out, "d_out", x);
  TORCH_CHECK(d_out.size(0) == x.size(0), "d_out.shape[0]=", d_out.size(0), " must equal x.shape[0]=", x.size(0));
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor d_weight = at::empty({d_out.size(1), x.size(1)}, x.options());
  std::optional<at::Tensor> d_bias;
  if (with_bias_grad) d_bias = at::empty({d_out.size(1)}, x.options());
  weight_grad_cuda(x, d_out, d_weight, d_bias);
  if (d_bias.has_value()) return {d_weight, *d_bias};
  return {d_weight};
}

// (d_pre, d_bias) for h = gelu_tanh(pre), y = h @ weight^T: d_pre = (d_out @ weight) * gelu_tanh'(pre),
// d_bias = d_pre.sum(0). weight [D, F], d_out [M, D], pre_act [M, F].
std::vector<at::Tensor> linear_dgelu_bias_grad(const at::Tensor& weight, const at::Tensor& d_out,
                                               const at::Tensor& pre_act, int64_t heuristic) {
  check_matrix(d_out, "d_out", d_out);
  check_matrix(weight, "weight", d_out);
  check_matrix(pre_act, "pre_act", d_out);
  TORCH_CHECK(weight.size(0) == d_out.size(1), "weight.shape[0]=", weight.size(0), " must equal d_out.shape[1]=",
              d_out.size(1));
  TORCH_CHECK(pre_act.size(0) == d_out.size(0) && pre_act.size(1) == weight.size(1), "pre_act must have shape [",
              d_out.size(0), ", ", weight.size(1), "], got ", pre_act.sizes());
  check_gelu_width(weight.size(1), "hidden_features");
  const c10::cuda::CUDAGuard device_guard(d_out.device());
  at::Tensor d_pre = at::empty_like(pre_act);
  at::Tensor d_bias = at::empty({weight.size(1)}, d_out.options());
  dgelu_bias_grad_cuda(weight, d_out, pre_act, d_pre, d_bias, heuristic);
  return {d_pre, d_bias};
}

}  // namespace tpflash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tpflash fused dense layers: cuBLASLt GEMMs with bias/GELU epilogues (float16, bfloat16)";
  m.def("linear_gelu_forward", &tpflash::linear_gelu_forward, "(out, pre_act) = gelu_tanh(x @ weight^T + bias)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("heuristic") = 0);
  m.def("linear_weight_grad", &tpflash::linear_weight_grad, "(d_weight[, d_bias]) of y = x @ weight^T + bias",
        py::arg("x"), py::arg("d_out"), py::arg("with_bias_grad"));
  m.def("linear_dgelu_bias_grad", &tpflash::linear_dgelu_bias_grad,
        "(d_pre, d_bias) through y = gelu_tanh(pre) @ weight^T", py::arg("weight"), py::arg("d_out"),
        py::arg("pre_act"), py::arg("heuristic") = 0);
}
