// tok_bench: tokenizes a JSONL corpus ({"text": ...} or {"hex": "<utf-8 bytes in hex>"} per line)
// with N threads, reports MB/s, and optionally writes the ids for comparison with HF
// (tools/tokenizer/compare_and_bench.py). Output file: per document, uint32 count then the ids.
// --pieces writes the pre-tokenizer's pieces the same way: per document, uint32 count then each
// piece's length in bytes (tools/tokenizer/npm_tokenizers_check.mjs compares them with HF's).
// --starts writes each token's start offset (Encode's `starts`) the same way; --decoded writes
// Decode(ids) of each document as a JSONL line {"text": ...}.
//
//   tok_bench --tokenizer tokenizer.json --corpus corpus.jsonl --threads 16 [--out ids.bin] [--repeat 3]
//             [--pieces pieces.bin] [--starts starts.bin] [--decoded decoded.jsonl]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"
#include "common/tokenizer/corpus.h"
#include "common/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app{"Tokenize a JSONL corpus and report throughput"};
  std::string tokenizer_path, corpus_path, out_path, pieces_path, starts_path, decoded_path;
  int threads = 1, repeat = 3;
  app.add_option("--tokenizer", tokenizer_path, "HF tokenizer.json")->required();
  app.add_option("--corpus", corpus_path, "JSONL corpus")->required();
  app.add_option("--threads", threads, "encoding threads");
  app.add_option("--repeat", repeat, "timed repetitions (best is reported)");
  app.add_option("--out", out_path, "write ids here");
  app.add_option("--pieces", pieces_path, "write the pre-tokenizer's piece lengths here");
  app.add_option("--starts", starts_path, "write each token's start offset here");
  app.add_option("--decoded", decoded_path, "write each document's decoded ids here (JSONL)");
  CLI11_PARSE(app, argc, argv);

  auto t0 = std::chrono::steady_clock::now();
  auto tok = slidedp::tok::Tokenizer::FromFile(tokenizer_path);
  if (!tok.ok()) {
    std::cerr << tok.status() << "\n";
    return 1;
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto docs = slidedp::tok::ReadCorpusJsonl(corpus_path);
  if (!docs.ok()) {
    std::cerr << docs.status() << "\n";
    return 1;
  }
  size_t bytes = 0;
  for (const auto& d : *docs) bytes += d.size();
  double best = 1e30;
  std::vector<std::vector<uint32_t>> ids;
  for (int r = 0; r < std::max(1, repeat); ++r) {
    auto s = std::chrono::steady_clock::now();
    ids = (*tok)->EncodeBatch(*docs, threads);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
  }
  size_t n_ids = 0;
  for (const auto& v : ids) n_ids += v.size();
  std::printf("{\"impl\": \"slidedp\", \"threads\": %d, \"documents\": %zu, \"bytes\": %zu, \"tokens\": %zu, "
              "\"seconds\": %.4f, \"MB_per_s\": %.2f, \"load_seconds\": %.3f}\n",
              threads, docs->size(), bytes, n_ids, best, bytes / best / 1e6, load_s);
  // Per document a uint32 count, then that many uint32.
  auto write_lists = [](const std::string& path, const std::vector<std::vector<uint32_t>>& lists) {
    std::ofstream out(path, std::ios::binary);
    for (const auto& v : lists) {
      const uint32_t n = static_cast<uint32_t>(v.size());
      out.write(reinterpret_cast<const char*>(&n), 4);
      out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
    }
  };
  if (!out_path.empty()) write_lists(out_path, ids);
  if (!starts_path.empty()) {
    std::vector<std::vector<uint32_t>> starts(docs->size());
    for (size_t i = 0; i < docs->size(); ++i) {
      (*tok)->Encode((*docs)[i], slidedp::tok::SpecialTokens::kRecognize, slidedp::tok::Normalized::kNo, &starts[i]);
    }
    write_lists(starts_path, starts);
  }
  if (!decoded_path.empty()) {
    std::ofstream out(decoded_path);
    for (const auto& v : ids) out << nlohmann::json{{"text", (*tok)->Decode(v)}}.dump() << "\n";
  }
  if (!pieces_path.empty()) {
    std::vector<std::vector<uint32_t>> lengths(docs->size());
    for (size_t i = 0; i < docs->size(); ++i) {
      for (const std::string& p : (*tok)->PreTokenize((*docs)[i])) lengths[i].push_back(static_cast<uint32_t>(p.size()));
    }
    write_lists(pieces_path, lengths);
  }
  return 0;
}
