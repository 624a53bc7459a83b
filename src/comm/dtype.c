/* Element types and names of the collectives: names of dtypes, ops, algorithms, comparisons and
 * all-reduce steps (logs, messages), and the host backend's fp16 / bf16 conversions. */
#include "comm/comm_state.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

/* ---- names -------------------------------------------------------------------------------- */

const char *skv__dtype_name(int dtype) {
  switch (dtype) {
  case SKV_DTYPE_BF16:
    return "bf16";
  case SKV_DTYPE_FP16:
    return "fp16";
  case SKV_DTYPE_FP32:
    return "fp32";
  default:
    return "?";
  }
}
const char *skv__op_name(int op) {
  switch (op) {
  case SKV_OP_SUM:
    return "sum";
  case SKV_OP_MAX:
    return "max";
  case SKV_OP_MIN:
    return "min";
  default:
    return "?";
  }
}
const char *skv__algo_name(int algo) {
  switch (algo) {
  case SKV_ALGO_AUTO:
    return "auto";
  case SKV_ALGO_ONESHOT:
    return "oneshot";
  case SKV_ALGO_TWOSHOT:
    return "twoshot";
  case SKV_ALGO_NCCL:
    return "nccl";
  default:
    return "?";
  }
}
const char *skv__check_name(uint64_t desc, uint64_t count, char *buf, size_t cap) {
  int kind = (int)(desc & 0xff), dtype = (int)(desc >> 8 & 0xff), op = (int)(desc >> 16 & 0xff),
      algo = (int)(desc >> 24 & 0xff), ch = (int)(desc >> 32 & 0xffff);
  if (kind == SKV__CHECK_BARRIER)
    snprintf(buf, cap, "skv_comm_barrier(channel %d)", ch);
  else if (kind == SKV__CHECK_ALLREDUCE)
    snprintf(buf, cap, "skv_comm_allreduce(count %" PRIu64 ", %s, %s, %s, channel %d)", count,
             skv__dtype_name(dtype), skv__op_name(op), skv__algo_name(algo), ch);
  else
    snprintf(buf, cap, "an unknown call (description %#" PRIx64 ", count %" PRIu64 ")", desc,
             count);
  return buf;
}
const char *skv__cmp_name(int cmp) {
  static const char *names[] = {"==", "!=", ">=", ">", "<", "<="};
  return cmp >= 0 && cmp < 6 ? names[cmp] : "?";
}
const char *skv__phase_name(int phase) {
  switch (phase) {
  case SKV__PHASE_ONESHOT:
    return "one-shot";
  case SKV__PHASE_RS:
    return "two-shot reduce-scatter";
  case SKV__PHASE_AG:
    return "two-shot all-gather";
  default:
    return "?";
  }
}

/* ---- half-precision conversions ---------------------------------------------------------- */

float skv__bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t skv__float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* NaN: the GPU's canonical one */
  u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest, ties to even */
  return (uint16_t)(u >> 16);
}

float skv__fp16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      uint32_t e = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        e--;
      }
      u = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t skv__float_to_fp16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;                     /* NaN: the GPU's canonical one */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to infinity */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    uint32_t exp = a >> 23;
    if (exp < 102) return sign; /* below 2^-25 */
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp, r = man >> shift, rem = man & ((1u << shift) - 1),
             half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
