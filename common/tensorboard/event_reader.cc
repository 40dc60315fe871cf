// Events file reading for tests; see event_reader.h.
#include "common/tensorboard/event_reader.h"

#include "absl/strings/str_cat.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/tensorboard/crc32c.h"
#include "tensorboard/event.pb.h"

namespace slidedp::tensorboard {
namespace {

uint64_t LoadLittleEndian(absl::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = bytes.size(); i-- > 0;) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
  return v;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> SplitRecords(absl::string_view file_bytes) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < file_bytes.size()) {
    absl::string_view rest = file_bytes.substr(at);
    if (rest.size() < 12) return absl::DataLossError(absl::StrCat("record at byte ", at, ": truncated header"));
    const uint64_t length = LoadLittleEndian(rest.substr(0, 8));
    if (MaskCrc(Crc32c(rest.substr(0, 8))) != LoadLittleEndian(rest.substr(8, 4))) {
      return absl::DataLossError(absl::StrCat("record at byte ", at, ": length CRC does not match"));
    }
    if (rest.size() < 16 || length > rest.size() - 16) {
      return absl::DataLossError(absl::StrCat("record at byte ", at, ": truncated (", length, " bytes of data)"));
    }
    absl::string_view data = rest.substr(12, length);
    if (MaskCrc(Crc32c(data)) != LoadLittleEndian(rest.substr(12 + length, 4))) {
      return absl::DataLossError(absl::StrCat("record at byte ", at, ": data CRC does not match"));
    }
    records.emplace_back(data);
    at += 16 + length;
  }
  return records;
}

absl::StatusOr<EventFileContents> ReadEventFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadSmallFile(path, 256ull << 20, "events file"));
  ASSIGN_OR_RETURN(std::vector<std::string> records, SplitRecords(bytes));
  EventFileContents out;
  for (size_t i = 0; i < records.size(); ++i) {
    Event event;
    if (!event.ParseFromString(records[i])) {
      return absl::DataLossError(absl::StrCat(path, ": record ", i, " is not an Event"));
    }
    if (i == 0) {
      if (!event.has_file_version()) {
        return absl::DataLossError(absl::StrCat(path, ": the first event has no file_version"));
      }
      out.file_version = event.file_version();
      out.first_wall_time = event.wall_time();
      continue;
    }
    for (const Summary::Value& v : event.summary().value()) {
      if (!v.has_simple_value()) continue;
      out.scalars.push_back({event.step(), event.wall_time(), v.tag(), v.simple_value()});
    }
  }
  if (records.empty()) return absl::DataLossError(absl::StrCat(path, ": no records"));
  return out;
}

}  // namespace slidedp::tensorboard
