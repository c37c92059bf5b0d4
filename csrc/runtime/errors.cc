/*
 * errors.cc: the thread-local last-error message, dtype helpers and the NCCL_EP_DEBUG lines
 * (errors.h). A device-side error word becomes a message in error_words.cc.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "errors.h"

namespace nccl_ep {

static thread_local std::string g_last_error;

void set_error(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
}

void debug_log(const char* fmt, ...) {
  static const bool enabled = [] {
    const char* v = getenv("NCCL_EP_DEBUG");
    return v != nullptr && strcmp(v, "1") == 0;
  }();
  if (!enabled) return;
  static const auto t0 = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  fprintf(stderr, "NCCL_EP_DEBUG pid %d %.3f s: %s\n", (int)getpid(), s, buf);
  fflush(stderr);
}

const char* dtype_name(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8: return "int8";
    case ncclUint8: return "uint8";
    case ncclInt32: return "int32";
    case ncclUint32: return "uint32";
    case ncclInt64: return "int64";
    case ncclUint64: return "uint64";
    case ncclFloat16: return "float16";
    case ncclFloat32: return "float32";
    case ncclFloat64: return "float64";
    case ncclBfloat16: return "bfloat16";
    case ncclFloat8e4m3: return "float8_e4m3";
    default: return "unsupported dtype";
  }
}

int dtype_bytes(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclFloat32:
    case ncclInt32: return 4;
    case ncclFloat64:
    case ncclInt64: return 8;
    default: return 0;
  }
}

}  // namespace nccl_ep

extern "C" const char* ncclEpGetLastError(void) { return nccl_ep::g_last_error.c_str(); }

extern "C" ncclResult_t ncclEpGetVersion(int* version) {
  EP_CHECK(version != nullptr, ncclInvalidArgument, "ncclEpGetVersion: version is NULL");
  *version = NCCL_EP_API_VERSION;
  return ncclSuccess;
}
