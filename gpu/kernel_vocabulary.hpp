// Internal: the words every kernel of gpupool is called with — what a vector is made of, how two
// vectors are compared, where a matrix of them lies, and how a kernel reports failure. One set,
// shared by the module (gpu/kernels.cpp turns the public Precision and Metric into these once),
// the CPU kernels (gpu/cpu_kernels.hpp) and the CUDA kernels (gpu/cuda/kernels.cuh).
//
// Plain C++17 without gpupool types: the .cu files include it too, and they cannot import modules.
#pragma once

#include <cstddef>

namespace gpupool::kernels {

// The element types a kernel reads vectors in (Precision's vector types, without Bytes).
enum class Element : int { Fp32, Fp16, Bf16, Int8 };

// The distances, as gpupool::Metric defines them (the same enumerators in the same order).
enum class Metric : int { L2, InnerProduct, Cosine };

constexpr std::size_t element_bytes(Element element) {
  return element == Element::Fp32 ? 4 : element == Element::Int8 ? 1 : 2;
}

// A row-major matrix of `rows` vectors; their length (dim) travels beside it. For Int8, `scales`
// holds one fp32 scale per row (value = scale · stored value); null for the other elements.
// `norms`: the rows' squared norms where the caller gave them (knn's corpus_norms, as row_norms
// computes them), else null: a kernel that needs them computes them.
struct Matrix {
  const void* data = nullptr;
  Element element = Element::Fp32;
  const float* scales = nullptr;
  std::size_t rows = 0;
  const float* norms = nullptr;
};

// How a CUDA kernel call ended (the CPU kernels cannot fail: their arguments are checked first).
// cuda: a cudaError_t, cublas: a cublasStatus_t (0 = success); what: the call that failed.
struct Status {
  int cuda = 0;
  int cublas = 0;
  const char* what = "";
  bool ok() const { return cuda == 0 && cublas == 0; }
};

}  // namespace gpupool::kernels
