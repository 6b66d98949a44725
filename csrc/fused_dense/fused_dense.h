// Shared by fused_dense.cpp (checks, allocation, Python bindings) and fused_dense_cuda.cu (cuBLASLt).
//
// Every matrix is a row-major PyTorch tensor; cuBLASLt is column-major, so each call below computes
// the transposed product (C^T = B^T A^T) without copying anything.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tpflash {

// out[M, N] = gelu_tanh(x[M, K] @ weight[N, K]^T + bias[N]); pre_act[M, N] = the GELU input.
// One cuBLASLt GEMM with the GELU_AUX_BIAS epilogue.
void gelu_forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       at::Tensor& out, at::Tensor& pre_act, int64_t heuristic);

// d_weight[N, K] = d_out[M, N]^T @ x[M, K]; d_bias[N] = d_out.sum(0) when d_bias is defined.
// One cuBLASLt GEMM, with the BGRADB epilogue when the bias gradient is wanted.
void weight_grad_cuda(const at::Tensor& x, const at::Tensor& d_out, at::Tensor& d_weight,
                      std::optional<at::Tensor>& d_bias);

// d_pre[M, F] = (d_out[M, D] @ weight[D, F]) * gelu_tanh'(pre_act[M, F]); d_bias[F] = d_pre.sum(0).
// The input gradient of the second linear of an MLP pushed through the GELU of the first:
// one cuBLASLt GEMM with the DGELU_BGRAD epilogue.
void dgelu_bias_grad_cuda(const at::Tensor& weight, const at::Tensor& d_out, const at::Tensor& pre_act,
                          at::Tensor& d_pre, at::Tensor& d_bias, int64_t heuristic);

}  // namespace tpflash
