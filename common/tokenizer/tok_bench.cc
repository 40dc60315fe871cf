// tok_bench: tokenizes a JSONL corpus ({"text": ...} or {"hex": "<utf-8 bytes in hex>"} per line)
// with N threads, reports MB/s, and optionally writes the ids for comparison with HF
// (tools/tokenizer/compare_and_bench.py). Output file: per document, uint32 count then the ids.
// --pieces writes the pre-tokenizer's pieces the same way: per document, uint32 count then each
// piece's length in bytes (tools/tokenizer/npm_tokenizers_check.mjs compares them with HF's).
//
//   tok_bench --tokenizer tokenizer.json --corpus corpus.jsonl --threads 16 [--out ids.bin] [--repeat 3]
//             [--pieces pieces.bin]
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/tokenizer/corpus.h"
#include "common/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app{"Tokenize a JSONL corpus and report throughput"};
  std::string tokenizer_path, corpus_path, out_path, pieces_path;
  int threads = 1, repeat = 3;
  app.add_option("--tokenizer", tokenizer_path, "HF tokenizer.json")->required();
  app.add_option("--corpus", corpus_path, "JSONL corpus")->required();
  app.add_option("--threads", threads, "encoding threads");
  app.add_option("--repeat", repeat, "timed repetitions (best is reported)");
  app.add_option("--out", out_path, "write ids here");
  app.add_option("--pieces", pieces_path, "write the pre-tokenizer's piece lengths here");
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
  if (!out_path.empty()) {
    std::ofstream out(out_path, std::ios::binary);
    for (const auto& v : ids) {
      const uint32_t n = static_cast<uint32_t>(v.size());
      out.write(reinterpret_cast<const char*>(&n), 4);
      out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
    }
  }
  if (!pieces_path.empty()) {
    std::ofstream out(pieces_path, std::ios::binary);
    for (const std::string& d : *docs) {
      const std::vector<std::string> pieces = (*tok)->PreTokenize(d);
      std::vector<uint32_t> lengths = {static_cast<uint32_t>(pieces.size())};
      for (const std::string& p : pieces) lengths.push_back(static_cast<uint32_t>(p.size()));
      out.write(reinterpret_cast<const char*>(lengths.data()), static_cast<std::streamsize>(lengths.size() * 4));
    }
  }
  return 0;
}
