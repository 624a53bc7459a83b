/* CUDA virtual memory management shared by the cuda heap backend and the elastic domain:
 * exportable device memory (cuMemCreate with POSIX file descriptors), mapping into a reserved
 * range, access for a device. Driver calls go through skv__cu (cuda/device.h). */
#ifndef SKV_VMM_H
#define SKV_VMM_H

#include "cuda/device.h"

/* Properties of pinned device memory on `dev` that can be exported as a POSIX fd. */
CUmemAllocationProp skv__vmm_prop(int dev);
/* The recommended granularity of such memory on `dev` (2 MiB when the driver cannot tell). */
uint64_t skv__vmm_granularity(int dev);
/* SKV_ENOTSUP with the way out when `dev` cannot export memory as POSIX fds. */
int skv__vmm_check_export(int dev);
/* Map `h` (bytes) at `at` and give `dev` read-write access to it; on failure nothing stays
 * mapped there. */
int skv__vmm_map(CUdeviceptr at, size_t bytes, CUmemGenericAllocationHandle h, int dev);

#endif
