// make_text_dataset: turns a plain-text file into a byte-level dataset for the tiny example
// model (token = byte value, 256 = end of document; vocab 512), one document per paragraph.
// Real tokenization of user data is `slidedp prepare` (common/tokenizer); this exists so the
// README's default job trains on real text with a model small enough for a CPU.
#include <fstream>
#include <iostream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "common/data/dataset.h"
#include "common/data/synthetic.h"

int main(int argc, char** argv) {
  std::string input, output, packing = "packed";
  int64_t seq_len = 128, vocab = 512, synthetic_docs = 0;
  int repeat = 1;
  CLI::App app{"make_text_dataset: byte-level dataset from a text file (tiny example model)"};
  app.add_option("--input", input, "text file; paragraphs (blank-line separated) become documents");
  app.add_option("--output", output, "dataset directory")->required();
  app.add_option("--seq-len", seq_len, "row length")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "model vocabulary (>= 257)")->check(CLI::Range(257, 1 << 30));
  app.add_option("--repeat", repeat, "repeat the corpus N times")->check(CLI::PositiveNumber);
  app.add_option("--synthetic-docs", synthetic_docs, "instead of text: N synthetic learnable documents");
  CLI11_PARSE(app, argc, argv);
  if (synthetic_docs > 0) {
    slidedp::data::SyntheticOptions o;
    o.vocab_size = vocab;
    o.num_documents = synthetic_docs;
    o.seq_len = seq_len;
    o.overwrite = slidedp::data::Overwrite::kYes;
    auto m = slidedp::data::WriteSyntheticDataset(output, o);
    if (!m.ok()) {
      std::cerr << m.status() << "\n";
      return 1;
    }
    std::cout << "wrote " << m->num_rows << " rows of synthetic data to " << output << "\n";
    return 0;
  }
  std::ifstream in(input);
  if (!in) {
    std::cerr << "cannot read " << input << "\n";
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<std::string> docs;
  std::string text = ss.str(), cur;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty()) {
      if (!cur.empty()) docs.push_back(cur);
      cur.clear();
    } else {
      cur += line + "\n";
    }
  }
  if (!cur.empty()) docs.push_back(cur);
  slidedp::data::WriterOptions wo;
  wo.vocab_size = vocab;
  wo.seq_len = seq_len;
  wo.overwrite = slidedp::data::Overwrite::kYes;
  wo.metadata = {{"tokenizer", "bytes+eos256"}, {"source", input}};
  auto writer = slidedp::data::DatasetWriter::Create(output, wo);
  if (!writer.ok()) {
    std::cerr << writer.status() << "\n";
    return 1;
  }
  for (int r = 0; r < repeat; ++r) {
    for (const std::string& d : docs) {
      std::vector<uint32_t> tokens;
      for (unsigned char c : d) tokens.push_back(c);
      tokens.push_back(256);
      std::vector<uint8_t> mask(tokens.size(), 1);
      if (auto s = (*writer)->AddDocument(tokens, mask); !s.ok()) {
        std::cerr << s << "\n";
        return 1;
      }
    }
  }
  auto m = (*writer)->Finish();
  if (!m.ok()) {
    std::cerr << m.status() << "\n";
    return 1;
  }
  std::cout << "wrote " << docs.size() * repeat << " documents, " << m->num_tokens << " tokens, " << m->num_rows
            << " rows to " << output << "\n";
  return 0;
}
