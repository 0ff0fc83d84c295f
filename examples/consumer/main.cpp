// Uses gpupool from its installed package: a pool, two buffers and an exact kNN query.
#include <cstdio>
#include <span>
#include <vector>
import gpupool;
using namespace gpupool;

int main() {
  auto device = Device::from_environment("sim:64MiB");  // GPUPOOL_DEVICE=cuda:0 on a GPU
  if (!device) return std::fprintf(stderr, "%s\n", device.error().to_string().c_str()), 1;
  GpuMemoryPool pool;  // buffers go back to it when they go out of scope
  std::vector<float> corpus{0, 0, 1, 1, 5, 5, 2, 2}, query{0.9f, 1.2f};  // 4 points and 1 query, dim 2
  auto x = pool.get_managed_buffer(*device, corpus.size(), Precision::Fp32);
  auto q = pool.get_managed_buffer(*device, query.size(), Precision::Fp32);
  if (!x || !q || !x->upload(std::span<const float>(corpus)) || !q->upload(std::span<const float>(query)))
    return std::fprintf(stderr, "allocation or upload failed\n"), 1;
  auto nearest = knn(pool, *q, *x, /*k=*/2, {.dim = 2});
  if (!nearest) return std::fprintf(stderr, "%s\n", nearest.error().to_string().c_str()), 1;
  auto ids = indices_to_host(nearest->indices);
  bool ok = ids && (*ids)[0] == 1 && (*ids)[1] == 3;
  std::printf("consumer: %s, nearest points %d and %d: %s\n", device->describe().c_str(),
              ids ? (*ids)[0] : -1, ids ? (*ids)[1] : -1, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
