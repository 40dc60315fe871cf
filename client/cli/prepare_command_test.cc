// `slidedp prepare`'s flags: parsed into PrepareOptions, --output optional only with --show, and
// refusals of bad values by CLI11 before anything runs.
#include "client/cli/prepare_command.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::client {
namespace {

using ::testing::HasSubstr;

std::string SourceDir() {
  const char* s = std::getenv("SLIDEDP_SOURCE_DIR");
  if (s != nullptr) return s;
  std::string here = __FILE__;
  return here.substr(0, here.rfind("/client/cli/"));
}

// Parses `slidedp prepare ARGS`; the parse error's text, or "" when it parsed.
std::string Parse(std::vector<std::string> args, PrepareCommand& command) {
  CLI::App app;
  AddPrepareCommand(app, command);
  args.insert(args.begin(), "prepare");
  std::vector<const char*> argv = {"slidedp"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(PrepareCommand, FlagsMapToOptions) {
  const std::string model = SourceDir() + "/tests/data/tokenizer/qwen3";
  const std::string input = SourceDir() + "/tests/data/tokenizer/chat_sample.jsonl";
  PrepareCommand c;
  ASSERT_EQ(Parse({"--model",
                   model,
                   "--input",
                   input,
                   "--output",
                   "/tmp/x",
                   "--format",
                   "sharegpt",
                   "--packing",
                   "padded",
                   "--loss-on",
                   "all",
                   "--chat-template",
                   "llama3.3",
                   "--text-eos",
                   "none",
                   "--skip-bad",
                   "--overwrite",
                   "--validation-fraction",
                   "0.1",
                   "--seq-len",
                   "128",
                   "--show",
                   "2"},
                  c),
            "");
  auto o = PrepareOptionsFromFlags(c);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model_dir, model);
  EXPECT_EQ(o->inputs, std::vector<std::string>{input});
  EXPECT_EQ(o->format, prepare::InputFormat::kShareGpt);
  EXPECT_EQ(o->packing, data::Packing::kPadded);
  EXPECT_EQ(o->loss_on, prepare::LossOn::kAll);
  EXPECT_EQ(o->chat_template, prepare::ChatTemplate::kLlama3_1);
  EXPECT_EQ(o->text_eos, prepare::TextEos::kNone);
  EXPECT_EQ(o->bad_lines, prepare::BadLines::kSkip);
  EXPECT_EQ(o->overwrite, data::Overwrite::kYes);
  EXPECT_EQ(o->validation_fraction, 0.1);
  EXPECT_EQ(o->seq_len, 128);
  EXPECT_EQ(c.show, 2);

  // Defaults: auto format, packed, assistant loss, EOS appended, fail on bad lines.
  PrepareCommand d;
  ASSERT_EQ(Parse({"--model", model, "--input", input, "--output", "/tmp/x"}, d), "");
  auto defaults = PrepareOptionsFromFlags(d);
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->format, prepare::InputFormat::kAuto);
  EXPECT_EQ(defaults->packing, data::Packing::kPacked);
  EXPECT_EQ(defaults->loss_on, prepare::LossOn::kAssistant);
  EXPECT_EQ(defaults->bad_lines, prepare::BadLines::kFail);
}

TEST(PrepareCommand, OutputIsOptionalOnlyWithShow) {
  const std::string model = SourceDir() + "/tests/data/tokenizer/qwen3";
  const std::string input = SourceDir() + "/tests/data/tokenizer/chat_sample.jsonl";
  PrepareCommand show;
  ASSERT_EQ(Parse({"--model", model, "--input", input, "--show", "3"}, show), "");
  EXPECT_TRUE(PrepareOptionsFromFlags(show).ok());
  PrepareCommand neither;
  ASSERT_EQ(Parse({"--model", model, "--input", input}, neither), "");
  auto o = PrepareOptionsFromFlags(neither);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(o.status().message()), HasSubstr("--output is required"));
}

TEST(PrepareCommand, BadValuesAreRefusedByTheParser) {
  const std::string model = SourceDir() + "/tests/data/tokenizer/qwen3";
  const std::string input = SourceDir() + "/tests/data/tokenizer/chat_sample.jsonl";
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"--format", "openai"}, {"--show", "0"}, {"--seq-len", "1"}, {"--validation-fraction", "1.5"}}) {
    PrepareCommand c;
    std::vector<std::string> args = {"--model", model, "--input", input, "--output", "/tmp/x"};
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_NE(Parse(args, c), "") << extra[0] << " " << extra[1];
  }
}

}  // namespace
}  // namespace slidedp::client
