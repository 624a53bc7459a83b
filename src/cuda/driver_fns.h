/* The driver API functions symkv resolves at run time: SKV_CU_FN(name, return type, args).
 * Included by cuda/device.h and .c with SKV_CU_FN defined; no include guard on purpose. */
SKV_CU_FN(cuGetErrorName, CUresult, (CUresult, const char **))
SKV_CU_FN(cuGetErrorString, CUresult, (CUresult, const char **))
SKV_CU_FN(cuMemCreate, CUresult,
          (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))
SKV_CU_FN(cuMemRelease, CUresult, (CUmemGenericAllocationHandle))
SKV_CU_FN(cuMemMap, CUresult,
          (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))
SKV_CU_FN(cuMemUnmap, CUresult, (CUdeviceptr, size_t))
SKV_CU_FN(cuMemSetAccess, CUresult, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))
SKV_CU_FN(cuMemAddressReserve, CUresult,
          (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))
SKV_CU_FN(cuMemAddressFree, CUresult, (CUdeviceptr, size_t))
SKV_CU_FN(cuMemExportToShareableHandle, CUresult,
          (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))
SKV_CU_FN(cuMemImportFromShareableHandle, CUresult,
          (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType))
SKV_CU_FN(cuMemGetAllocationGranularity, CUresult,
          (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))
SKV_CU_FN(cuDeviceGetAttribute, CUresult, (int *, CUdevice_attribute, CUdevice))
SKV_CU_FN(cuStreamWaitValue64, CUresult, (CUstream, CUdeviceptr, cuuint64_t, unsigned int))
