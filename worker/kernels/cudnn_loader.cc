// Loading libcudnn and reporting its errors; see cudnn_loader.h.
#include "worker/kernels/cudnn_loader.h"

#ifdef SLIDEDP_HAVE_CUDNN_GRAPH_H

#include <dlfcn.h>
#include <sys/stat.h>

#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/debug/debug_switches.h"

namespace slidedp::kernels::cudnn_internal {
namespace {

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::StatusOr<CudnnApi> LoadCudnnOnce() {
  std::vector<std::string> candidates;
  std::string dir;
  // SLIDEDP_CUDNN_LIB (worker/debug/debug_switches.h).
  const absl::StatusOr<DebugSwitches>& switches = ProcessDebugSwitches();
  if (!switches.ok()) return switches.status();
  if (!switches->cudnn_library.empty()) {
    std::string p = switches->cudnn_library;
    if (IsDirectory(p)) {
      dir = p;
      p += "/libcudnn.so.9";
    } else if (const size_t slash = p.rfind('/'); slash != std::string::npos) {
      dir = p.substr(0, slash);
    }
    candidates.push_back(p);
  }
  candidates.push_back("libcudnn.so.9");
  // libcudnn.so.9 is a shim that dlopens its sub-libraries by soname. Loading them first from
  // the same directory (RTLD_GLOBAL) lets those lookups find them without LD_LIBRARY_PATH, as
  // with PyTorch's pip wheel (site-packages/nvidia/cudnn/lib). Failures here are not fatal.
  if (!dir.empty()) {
    for (const char* sub : {"libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn_engines_precompiled.so.9",
                            "libcudnn_engines_runtime_compiled.so.9"}) {
      dlopen((dir + "/" + sub).c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
  }
  CudnnApi api;
  std::string errors;
  for (const std::string& c : candidates) {
    api.lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (api.lib != nullptr) break;
    const char* e = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", e != nullptr ? e : c);
  }
  if (api.lib == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cudnn attention: cannot load libcudnn.so.9 (set SLIDEDP_CUDNN_LIB): ", errors));
  }
  bool missing = false;
  std::string missing_names;
  auto resolve = [&](auto& fn, const char* name, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(api.lib, name));
    if (fn == nullptr && required) {
      missing = true;
      absl::StrAppend(&missing_names, " ", name);
    }
  };
  resolve(api.GetVersion, "cudnnGetVersion", true);
  resolve(api.GetErrorString, "cudnnGetErrorString", true);
  resolve(api.GetLastErrorString, "cudnnGetLastErrorString", false);
  resolve(api.Create, "cudnnCreate", true);
  resolve(api.Destroy, "cudnnDestroy", true);
  resolve(api.SetStream, "cudnnSetStream", true);
  resolve(api.CreateDescriptor, "cudnnBackendCreateDescriptor", true);
  resolve(api.DestroyDescriptor, "cudnnBackendDestroyDescriptor", true);
  resolve(api.SetAttribute, "cudnnBackendSetAttribute", true);
  resolve(api.GetAttribute, "cudnnBackendGetAttribute", true);
  resolve(api.Finalize, "cudnnBackendFinalize", true);
  resolve(api.Execute, "cudnnBackendExecute", true);
  if (missing) return absl::UnavailableError(absl::StrCat("cudnn attention: libcudnn lacks", missing_names));
  api.version = static_cast<int64_t>(api.GetVersion());
  if (api.version < 90000) {
    return absl::UnavailableError(absl::StrCat("cudnn attention: needs cuDNN >= 9.0, found ", api.version));
  }
  return api;
}

std::string LastError(const CudnnApi& api) {
  if (api.GetLastErrorString == nullptr) return "";
  char buf[512] = {};
  api.GetLastErrorString(buf, sizeof(buf));
  return buf;
}

}  // namespace

// Loaded once per process and never unloaded (cuDNN keeps kernels and threads alive).
absl::StatusOr<const CudnnApi*> LoadCudnn() {
  static const absl::StatusOr<CudnnApi>* const api = new absl::StatusOr<CudnnApi>(LoadCudnnOnce());
  if (!api->ok()) return api->status();
  return &**api;
}

absl::Status CudnnError(const CudnnApi& api, cudnnStatus_t st, const std::string& what, Phase phase) {
  const std::string detail = LastError(api);
  const std::string msg = absl::StrCat("cudnn attention: ", what, ": ", api.GetErrorString(st),
                                       detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")");
  // NOT_SUPPORTED* and BAD_PARAM* while building a graph mean "this cuDNN has no engine for it";
  // the caller falls back to the own kernels. At run time every failure is an error.
  const bool unsupported = (st >= CUDNN_STATUS_NOT_SUPPORTED && st < CUDNN_STATUS_INTERNAL_ERROR) ||
                           (st >= CUDNN_STATUS_BAD_PARAM && st < CUDNN_STATUS_NOT_SUPPORTED);
  return phase == Phase::kBuild && unsupported ? absl::UnimplementedError(msg) : absl::InternalError(msg);
}

}  // namespace slidedp::kernels::cudnn_internal

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H
