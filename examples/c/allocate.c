/* gpupool from C: a pool over a simulated device (GPUPOOL_DEVICE or argv[1] picks another, e.g.
 * cuda:0), a few allocations, the figures, a refusal and its message, and cleanup.
 * Exits 0 only when every step did what the header says. */
#include <stdio.h>
#include <string.h>

#include "gpupool/gpupool.h"

static int check(gpupool_status status, const char* what) {
  if (status == GPUPOOL_OK) return 1;
  fprintf(stderr, "%s: %s: %s\n", what, gpupool_status_name(status), gpupool_last_error());
  return 0;
}

int main(int argc, char** argv) {
  const char* spec = argc > 1 ? argv[1] : "sim:64MiB";
  int device = -1;
  gpupool_config config;
  gpupool_pool* pool = NULL;
  gpupool_stats stats;
  void* blocks[3] = {NULL, NULL, NULL};
  const size_t sizes[3] = {1000, 1u << 20, 5u << 20};
  size_t released = 0;
  void* too_big = NULL;
  int i;

  if (!check(gpupool_device_open(spec, &device), "gpupool_device_open")) return 1;
  gpupool_config_init(&config);
  config.max_pool_size = 16u << 20;
  if (!check(gpupool_pool_create(&config, &pool), "gpupool_pool_create")) return 1;

  for (i = 0; i < 3; ++i)
    if (!check(gpupool_allocate(pool, device, sizes[i], NULL, &blocks[i]), "gpupool_allocate")) return 1;

  memset(&stats, 0, sizeof stats);
  stats.struct_size = sizeof stats;
  if (!check(gpupool_get_stats(pool, device, &stats), "gpupool_get_stats")) return 1;
  printf("live %llu, requested %zu bytes, in use %zu, reserved %zu\n",
         (unsigned long long)stats.live_allocations, stats.requested_bytes, stats.in_use_bytes,
         stats.reserved_bytes);
  if (stats.live_allocations != 3 || stats.requested_bytes != sizes[0] + sizes[1] + sizes[2]) return 1;

  /* Past the 16 MiB limit: refused with a status of its own and a message saying why. */
  if (gpupool_allocate(pool, device, 12u << 20, NULL, &too_big) != GPUPOOL_POOL_LIMIT_EXCEEDED) return 1;
  printf("refused as expected: %s\n", gpupool_last_error());

  for (i = 0; i < 3; ++i)
    if (!check(gpupool_deallocate(pool, blocks[i], NULL), "gpupool_deallocate")) return 1;
  if (!check(gpupool_cleanup(pool, device, &released), "gpupool_cleanup")) return 1;
  printf("cleanup gave %zu bytes back\n", released);
  gpupool_pool_release(pool);
  return released > 0 ? 0 : 1;
}
