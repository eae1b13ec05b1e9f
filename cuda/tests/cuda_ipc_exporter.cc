// Helper of cuda_logic_test, run only where a CUDA device exists: plays a trainer that
// exports one cudaMalloc'd buffer over CUDA IPC.
//
//   cuda_ipc_exporter BYTES
// Fills BYTES bytes of device memory with byte i = (i * 7 + 3) & 0xff, prints the
// buffer's region name ("cuda:<uuid>:<handle>") on a line, then waits for a line on
// stdin; then checks that the first BYTES / 2 bytes now hold (i * 13 + 1) & 0xff (what
// the test wrote through the importer) and the rest is unchanged, and prints "ok" or
// "bad <index>".
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cuda/cuda_importer.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::size_t bytes = std::strtoull(argv[1], nullptr, 10);
  auto fail = [](const char* what, cudaError_t err) {
    std::cout << "error " << what << ": " << cudaGetErrorString(err) << std::endl;
    return 1;
  };
  if (cudaError_t e = cudaSetDevice(0); e != cudaSuccess) return fail("cudaSetDevice", e);
  void* dev = nullptr;
  if (cudaError_t e = cudaMalloc(&dev, bytes); e != cudaSuccess) return fail("cudaMalloc", e);
  std::vector<unsigned char> host(bytes);
  for (std::size_t i = 0; i < bytes; ++i) host[i] = static_cast<unsigned char>((i * 7 + 3) & 0xff);
  if (cudaError_t e = cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice); e != cudaSuccess) {
    return fail("cudaMemcpy", e);
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, dev); e != cudaSuccess)
    return fail("cudaIpcGetMemHandle", e);
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, 0); e != cudaSuccess) {
    return fail("cudaGetDeviceProperties", e);
  }
  ckpt::cuda::CudaRegionRef ref;
  std::memcpy(ref.device.bytes.data(), prop.uuid.bytes, ref.device.bytes.size());
  std::memcpy(ref.handle.bytes.data(), handle.reserved, ref.handle.bytes.size());
  std::cout << ckpt::cuda::FormatCudaRegionName(ref) << std::endl;

  std::string line;
  if (!std::getline(std::cin, line)) return 3;
  if (cudaError_t e = cudaMemcpy(host.data(), dev, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
    return fail("cudaMemcpy back", e);
  }
  for (std::size_t i = 0; i < bytes; ++i) {
    unsigned char want = static_cast<unsigned char>(i < bytes / 2 ? (i * 13 + 1) & 0xff : (i * 7 + 3) & 0xff);
    if (host[i] != want) {
      std::cout << "bad " << i << std::endl;
      return 1;
    }
  }
  std::cout << "ok" << std::endl;
  cudaFree(dev);
  return 0;
}
