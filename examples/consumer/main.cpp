// Uses gpupool from its installed package: a simulated device, an upload and a download.
#include <cstdio>
#include <vector>
import gpupool;

int main() {
  auto device = gpupool::Device::from_environment("sim:64MiB");
  if (!device) {
    std::fprintf(stderr, "%s\n", device.error().to_string().c_str());
    return 1;
  }
  std::vector<float> host(1024, 1.5f), back(1024, 0.0f);
  auto memory = device->allocate(host.size() * sizeof(float));
  if (!memory) {
    std::fprintf(stderr, "%s\n", memory.error().to_string().c_str());
    return 1;
  }
  auto stream = device->default_stream();
  bool ok = device->copy(*memory, host.data(), 4096, gpupool::CopyKind::HostToDevice, stream) &&
            device->copy(back.data(), *memory, 4096, gpupool::CopyKind::DeviceToHost, stream) &&
            stream.synchronize() && device->deallocate(*memory);
  std::printf("consumer: %s, round trip %s\n", device->describe().c_str(),
              ok && back == host ? "ok" : "FAILED");
  return ok && back == host ? 0 : 1;
}
