// cuBLASLt GEMMs with fused epilogues for the dense layers of an MLP (bias + GELU forward, GELU
// derivative + bias gradient backward, bias gradient of a plain linear). Host code only: the
// epilogues run inside cuBLASLt's own kernels.
//
// Row-major PyTorch X[M, K] is column-major X^T[K, M] with leading dimension K, so each product is
// written as its transpose: row-major C = A @ B is column-major C^T = B^T @ A^T.
#include "fused_dense.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace tpflash {
namespace {

// What flash-attention and TransformerEngine give cuBLASLt on Hopper; from PyTorch's caching
// allocator on the current stream, so it costs no cudaMalloc after the first call.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kMaxAlgos = 8;

#define TPFLASH_LT_CHECK(expr)                                                               \
  do {                                                                                       \
    const cublasStatus_t status_ = (expr);                                                   \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "tpflash_fused_dense: ", #expr, " failed: ", \
                cublasLtGetStatusString(status_));                                           \
  } while (0)

// One cuBLASLt handle per device, created on first use and kept for the life of the process.
cublasLtHandle_t lt_handle() {
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;
  const int device = static_cast<int>(c10::cuda::current_device());
  std::lock_guard<std::mutex> lock(mutex);
  if (handles.size() <= static_cast<size_t>(device)) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) TPFLASH_LT_CHECK(cublasLtCreate(&handles[device]));
  return handles[device];
}

cudaDataType_t cuda_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "tpflash_fused_dense: dtype ", t.scalar_type(), " is not float16 or bfloat16");
  return t.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

// One column-major product D[m, n] = op(A)[m, k] @ op(B)[k, n], then an epilogue.
struct LtGemm {
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  cudaDataType_t dtype = CUDA_R_16BF;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;  // the bias (read) or the bias gradient (written), as the epilogue says
  void* aux = nullptr;   // the GELU input: written by GELU_AUX_BIAS, read by DGELU_BGRAD
  int64_t aux_ld = 0;
};

// Owns the descriptors of one call; destroyed after the matmul is enqueued, as cuBLASLt allows.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <typename T>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  TPFLASH_LT_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

// Runs g on the current stream with the heuristic's `heuristic`-th algorithm (clamped to those found).
void lt_matmul(const LtGemm& g, const at::Tensor& like, int64_t heuristic) {
  LtDescriptors desc;
  TPFLASH_LT_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a);
  set_attribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b);
  set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
  if (g.bias != nullptr) set_attribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux != nullptr) {
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    set_attribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  // Layouts describe the matrices as stored, before op() is applied.
  const bool a_plain = g.trans_a == CUBLAS_OP_N, b_plain = g.trans_b == CUBLAS_OP_N;
  TPFLASH_LT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, g.dtype, a_plain ? g.m : g.k, a_plain ? g.k : g.m, g.lda));
  TPFLASH_LT_CHECK(cublasLtMatrixLayoutCreate(&desc.b, g.dtype, b_plain ? g.k : g.n, b_plain ? g.n : g.k, g.ldb));
  TPFLASH_LT_CHECK(cublasLtMatrixLayoutCreate(&desc.d, g.dtype, g.m, g.n, g.ldd));

  size_t workspace_bytes = kWorkspaceBytes;
  TPFLASH_LT_CHECK(cublasLtMatmulPreferenceCreate(&desc.preference));
  TPFLASH_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_bytes, sizeof(workspace_bytes)));
  const cublasLtHandle_t handle = lt_handle();
  cublasLtMatmulHeuristicResult_t algos[kMaxAlgos] = {};
  int found = 0;
  TPFLASH_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.preference,
                                                  kMaxAlgos, algos, &found));
  TORCH_CHECK(found > 0, "tpflash_fused_dense: cuBLASLt has no algorithm for epilogue ", static_cast<int>(g.epilogue),
              " with m=", g.m, " n=", g.n, " k=", g.k);
  const int pick = static_cast<int>(std::min<int64_t>(std::max<int64_t>(heuristic, 0), found - 1));

  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, like.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 0.0f;
  TPFLASH_LT_CHECK(cublasLtMatmul(handle, desc.op, &alpha, g.a, desc.a, g.b, desc.b, &beta, g.d, desc.d, g.d, desc.d,
                                  &algos[pick].algo, workspace.data_ptr(), workspace_bytes,
                                  c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

void gelu_forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& out,
                       at::Tensor& pre_act, int64_t heuristic) {
  // Column-major out^T[N, M] = weight[N, K] @ x^T[K, M]: weight is stored as W^T[K, N] (ld K).
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight.size(0);
  LtGemm g;
  g.trans_a = CUBLAS_OP_T;
  g.trans_b = CUBLAS_OP_N;
  g.m = out_features;
  g.n = rows;
  g.k = in_features;
  g.a = weight.data_ptr();
  g.lda = in_features;
  g.b = x.data_ptr();
  g.ldb = in_features;
  g.d = out.data_ptr();
  g.ldd = out_features;
  g.dtype = cuda_dtype(x);
  g.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  g.bias = bias.data_ptr();  // length m = out_features: one per row of the column-major result
  g.aux = pre_act.data_ptr();
  g.aux_ld = out_features;
  lt_matmul(g, x, heuristic);
}

void weight_grad_cuda(const at::Tensor& x, const at::Tensor& d_out, at::Tensor& d_weight,
                      std::optional<at::Tensor>& d_bias) {
  // Column-major d_weight^T[K, N] = x^T[K, M] @ d_out[M, N]; BGRADB sums op(B) = d_out over k = M.
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = d_out.size(1);
  LtGemm g;
  g.trans_a = CUBLAS_OP_N;
  g.trans_b = CUBLAS_OP_T;
  g.m = in_features;
  g.n = out_features;
  g.k = rows;
  g.a = x.data_ptr();
  g.lda = in_features;
  g.b = d_out.data_ptr();
  g.ldb = out_features;
  g.d = d_weight.data_ptr();
  g.ldd = in_features;
  g.dtype = cuda_dtype(x);
  if (d_bias.has_value()) {
    g.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    g.bias = d_bias->data_ptr();
  }
  lt_matmul(g, x, /*heuristic=*/0);
}

void dgelu_bias_grad_cuda(const at::Tensor& weight, const at::Tensor& d_out, const at::Tensor& pre_act,
                          at::Tensor& d_pre, at::Tensor& d_bias, int64_t heuristic) {
  // Column-major d_pre^T[F, M] = weight^T[F, D] @ d_out^T[D, M]; weight [D, F] is stored as W^T[F, D]
  // (ld F). DGELU multiplies by gelu'(pre_act) and BGRAD sums the rows of the result over n = M.
  const int64_t rows = d_out.size(0), out_features = d_out.size(1), hidden = weight.size(1);
  LtGemm g;
  g.trans_a = CUBLAS_OP_N;
  g.trans_b = CUBLAS_OP_N;
  g.m = hidden;
  g.n = rows;
  g.k = out_features;
  g.a = weight.data_ptr();
  g.lda = hidden;
  g.b = d_out.data_ptr();
  g.ldb = out_features;
  g.d = d_pre.data_ptr();
  g.ldd = hidden;
  g.dtype = cuda_dtype(d_out);
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;
  g.bias = d_bias.data_ptr();
  g.aux = pre_act.data_ptr();
  g.aux_ld = hidden;
  lt_matmul(g, d_out, heuristic);
}

}  // namespace tpflash
