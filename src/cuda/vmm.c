/* CUDA virtual memory management shared by the cuda heap backend and the elastic domain:
 * exportable allocations, their granularity, mapping with device access. */
#include "cuda/vmm.h"

#include <string.h>

CUmemAllocationProp skv__vmm_prop(int dev) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

uint64_t skv__vmm_granularity(int dev) {
  CUmemAllocationProp prop = skv__vmm_prop(dev);
  size_t g = 0;
  if (skv__cu.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) !=
          CUDA_SUCCESS ||
      g == 0)
    g = 2ull << 20;
  return g;
}

int skv__vmm_check_export(int dev) {
  int ok = 0;
  skv__cu.cuDeviceGetAttribute(&ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                               dev);
  if (!ok)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_HEAP,
                    "GPU %d cannot export memory as POSIX file descriptors (needed to share it "
                    "between processes); use SKV_BACKEND_CUDA_HOST",
                    dev);
  return 0;
}

int skv__vmm_map(CUdeviceptr at, size_t bytes, CUmemGenericAllocationHandle h, int dev) {
  int rc = 0;
  SKV_CU_CHECK_GOTO(skv__cu.cuMemMap(at, bytes, 0, h, 0), SKV_SUBSYS_HEAP, rc, out);
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = dev;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  SKV_CU_CHECK_GOTO(skv__cu.cuMemSetAccess(at, bytes, &acc, 1), SKV_SUBSYS_HEAP, rc, unmap);
  return 0;
unmap:
  skv__cu.cuMemUnmap(at, bytes);
out:
  return rc;
}
