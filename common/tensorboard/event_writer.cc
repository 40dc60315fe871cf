// Event file writing; see event_writer.h.
#include "common/tensorboard/event_writer.h"

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"
#include "common/tensorboard/crc32c.h"
#include "tensorboard/event.pb.h"

namespace slidedp::tensorboard {
namespace {

std::string HostName() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

std::atomic<int64_t> next_file_uid{0};

// Little endian whatever the host's order, as the format fixes it.
void StoreLittleEndian(uint64_t v, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

std::string FrameRecord(absl::string_view data) {
  std::string out;
  out.resize(8 + 4 + data.size() + 4);
  char* p = out.data();
  StoreLittleEndian(data.size(), 8, p);
  StoreLittleEndian(MaskCrc(Crc32c(absl::string_view(p, 8))), 4, p + 8);
  data.copy(p + 12, data.size());
  StoreLittleEndian(MaskCrc(Crc32c(data)), 4, p + 12 + data.size());
  return out;
}

std::string EventFileName(int64_t unix_seconds, absl::string_view host, int pid, int64_t uid) {
  return absl::StrFormat("events.out.tfevents.%010d.%s.%d.%d.slidedp", unix_seconds, host, pid, uid);
}

absl::StatusOr<std::unique_ptr<EventFileWriter>> EventFileWriter::Create(const std::string& dir, absl::Time now) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("TensorBoard directory ", dir, ": ", ec.message()));
  const std::string path = (std::filesystem::path(dir) /
                            EventFileName(absl::ToUnixSeconds(now), HostName(), getpid(), next_file_uid.fetch_add(1)))
                               .string();
  // O_EXCL: a file of another writer is never appended to.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0666);
  if (fd < 0) return ErrnoStatus(absl::StrCat("create ", path), errno);
  auto writer = std::unique_ptr<EventFileWriter>(new EventFileWriter(fd, path));
  Event first;
  first.set_wall_time(UnixSeconds(now));
  first.set_file_version(std::string(kFileVersion));
  RETURN_IF_ERROR(writer->WriteRecord(first.SerializeAsString()));
  return writer;
}

EventFileWriter::~EventFileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status EventFileWriter::WriteScalars(int64_t step, absl::Time wall_time, absl::Span<const Scalar> scalars) {
  Event event;
  event.set_wall_time(UnixSeconds(wall_time));
  event.set_step(step);
  Summary* summary = event.mutable_summary();
  for (const Scalar& s : scalars) {
    Summary::Value* v = summary->add_value();
    v->set_tag(s.tag);
    v->set_simple_value(s.value);
  }
  return WriteRecord(event.SerializeAsString());
}

absl::Status EventFileWriter::WriteRecord(absl::string_view data) {
  const std::string record = FrameRecord(data);
  absl::string_view left = record;
  while (!left.empty()) {
    const ssize_t n = ::write(fd_, left.data(), left.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(absl::StrCat("write ", path_), errno);
    if (n == 0) return absl::DataLossError(absl::StrCat("write ", path_, ": no progress"));
    left.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::tensorboard
