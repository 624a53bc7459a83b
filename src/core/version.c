/* Library version, as loaded (callers compare it with the SKV_VERSION_* of their header). */
#include "core/core.h"

#include <stdio.h>

unsigned int skv_version(void) {
  return SKV_VERSION_HEX;
}

#define SKV__STR2(x) #x
#define SKV__STR(x)  SKV__STR2(x)

const char *skv_version_string(void) {
  static const char *s =
      SKV__STR(SKV_VERSION_MAJOR) "." SKV__STR(SKV_VERSION_MINOR) "." SKV__STR(SKV_VERSION_PATCH)
#ifdef SKV_WITH_CUDA
          " (cuda " SKV__STR(SKV_CUDA_VERSION_MAJOR) "." SKV__STR(SKV_CUDA_VERSION_MINOR)
#ifdef SKV_WITH_NCCL
              ", nccl)"
#else
              ")"
#endif
#else
          " (host only)"
#endif
      ;
  return s;
}
