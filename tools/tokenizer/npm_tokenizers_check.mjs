// Checks slidedp's tokenizer against HF `tokenizers` (its Rust library, through the npm package
// `tokenizers`, the same 0.23.2 the GPU machine's Python uses) without Python:
//
//   mkdir -p /tmp/hf-tok-ref && (cd /tmp/hf-tok-ref && npm install tokenizers@0.23.2)
//   export NODE_PATH=/tmp/hf-tok-ref/node_modules
//   node tools/tokenizer/npm_tokenizers_check.mjs make-qwen3.5 tests/data/tokenizer/qwen3.5-synthetic
//   node tools/tokenizer/npm_tokenizers_check.mjs make-o200k tests/data/tokenizer/o200k-synthetic
//   node tools/tokenizer/npm_tokenizers_check.mjs make-sentencepiece STYLE DIR   (STYLE: mistral, metaspace, gemma3)
//   node tools/tokenizer/npm_tokenizers_check.mjs expected TOKENIZER_JSON CORPUS_JSONL OUT_JSONL
//   node tools/tokenizer/npm_tokenizers_check.mjs variants TOKENIZER_JSON CORPUS_JSONL OUT_JSONL
//   node tools/tokenizer/npm_tokenizers_check.mjs add-ids TOKENIZER_JSON JSONL
//   node tools/tokenizer/npm_tokenizers_check.mjs compare TOKENIZER_JSON TOK_BENCH [--sweep] [--fuzz N] \
//       [CORPUS...]
//
// make-qwen3.5: Qwen3.5's tokenizer.json (Qwen/Qwen3.5-*, also Qwen3.6) has the structure of
//   Qwen3's (NFC normalizer; Split(Regex, Isolated) then ByteLevel(use_regex=false); ByteLevel
//   decoder and post-processor; BPE without byte_fallback) with its own split regex, which adds
//   \p{M} to the letter runs, a 248,044-entry vocabulary and 33 added tokens (21 special). This
//   writes a tokenizer.json of exactly that structure over a small vocabulary learnt here
//   (byte-level BPE on HF's own pre-tokenization, most frequent pair first, ties to the pair seen
//   first, at most 1,500 merges) from a multilingual text, with the 33 added tokens numbered after
//   it in Qwen3.5's order. Deterministic.
// make-o200k: the same for GPT-OSS's tokenizer.json structure (o200k_harmony: no normalizer, o200k's
//   split regex, harmony's added tokens from <|startoftext|> to <|call|>; O200K_* below).
// make-sentencepiece: a tokenizer.json of a real SentencePiece-style structure (BPE with
//   byte_fallback over characters, `▁` for a space; docs/tokenizer.md, "SentencePiece-style BPE")
//   over a small vocabulary learnt here from the same text (characters seen at least 3 times, so
//   the others fall back to <0xNN> bytes; at most 800 merges within ▁-words, as SentencePiece
//   trains): "mistral" is Mistral v0.1-v0.3's and Llama 2's (Prepend + Replace normalizer, no
//   pre-tokenizer, merges as "a b" strings, decoder Replace/ByteFallback/Fuse/Strip, <s> template,
//   Mistral v0.3's control tokens first); "metaspace" is what transformers writes for them with
//   legacy=false (no normalizer, Metaspace(prepend_scheme first, split false)); "gemma3" is Gemma
//   3's (Replace normalizer, Split(" ", MergedWithPrevious), decoder Replace/ByteFallback/Fuse,
//   <bos> template, its added tokens: newline, ▁ and tab runs, HTML tags, unused and image tokens,
//   one past the vocabulary). Deterministic.
// expected: HF's ids (add_special_tokens=false) for each document of a corpus, one {"ids": [...]}
//   per line (the format of tests/data/tokenizer/*.expected.jsonl); for SentencePiece-style
//   tokenizers also "starts" (each token's start offset, in code points), "decoded" (HF's decode
//   of the ids) and "before" / "after" (what add_special_tokens=true adds around them).
// variants: the same for variants of a SentencePiece-style tokenizer.json (other prepend schemes,
//   split, Split behaviours, unk instead of byte fallback, ignore_merges, other decoders: VARIANTS
//   below), one line per variant: {"name", "patch" (the tokenizer.json fields it replaces; "model"
//   fields merged), "docs": [{"ids", "decoded"}...]}.
// add-ids: adds HF's "ids" of "text" to each line of a JSONL file (the chat-template oracle,
//   tools/chat_template/jinja2_render.py).
// compare: runs tok_bench --out --pieces --starts --decoded on each corpus and HF on the same
//   documents, compares the ids and the pre-tokenizer's pieces (a small vocabulary can give the
//   same ids for two different splits), and for SentencePiece-style tokenizers the token starts
//   and the decoded text, reports mismatching documents (first difference and the text around it)
//   and exits 1 on any.
//   --sweep adds documents holding every Unicode scalar value in contexts the split regex
//   distinguishes (after a letter, after a space, after punctuation, before a digit, after an
//   apostrophe, ...); --fuzz N adds N seeded random multi-script documents.
// Corpus format: tok_bench's ({"text": ...} or {"hex": ...} per line).
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { Tokenizer } = require("tokenizers");

const QWEN3_5_SPLIT_REGEX =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// Qwen3.5's added tokens in id order after the vocabulary: Qwen3's 26 (special through
// <|video_pad|>, then the tool / FIM / think tags, not special), then 7 audio/TTS tokens (special).
const QWEN3_5_ADDED = [
  ["<|endoftext|>", true], ["<|im_start|>", true], ["<|im_end|>", true], ["<|object_ref_start|>", true],
  ["<|object_ref_end|>", true], ["<|box_start|>", true], ["<|box_end|>", true], ["<|quad_start|>", true],
  ["<|quad_end|>", true], ["<|vision_start|>", true], ["<|vision_end|>", true], ["<|vision_pad|>", true],
  ["<|image_pad|>", true], ["<|video_pad|>", true], ["<tool_call>", false], ["</tool_call>", false],
  ["<|fim_prefix|>", false], ["<|fim_middle|>", false], ["<|fim_suffix|>", false], ["<|fim_pad|>", false],
  ["<|repo_name|>", false], ["<|file_sep|>", false], ["<tool_response>", false], ["</tool_response>", false],
  ["<think>", false], ["</think>", false], ["<|audio_start|>", true], ["<|audio_end|>", true],
  ["<tts_pad>", true], ["<tts_text_bos>", true], ["<tts_text_eod>", true], ["<tts_text_bos_single>", true],
  ["<|audio_pad|>", true],
];

// GPT-OSS's tokenizer.json (openai/gpt-oss-*: o200k_harmony, tiktoken's o200k_base converted): no
// normalizer; Split on o200k's regex (letter runs by case, with marks; contractions case-insensitive
// and optional; digits by three; punctuation runs that may end in newlines or '/'), Isolated; then
// ByteLevel without regex; BPE without byte fallback. Its added tokens are harmony's, 199998 onwards
// (the reserved ones up to 201087 left out here: they are plain specials).
const O200K_SPLIT_REGEX =
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|" +
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|" +
  "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const O200K_ADDED = [
  ["<|startoftext|>", true], ["<|endoftext|>", true], ["<|reserved_200000|>", true], ["<|reserved_200001|>", true],
  ["<|return|>", true], ["<|constrain|>", true], ["<|reserved_200004|>", true], ["<|channel|>", true],
  ["<|start|>", true], ["<|end|>", true], ["<|message|>", true], ["<|reserved_200009|>", true],
  ["<|reserved_200010|>", true], ["<|reserved_200011|>", true], ["<|call|>", true],
];
const BYTE_LEVEL_STYLES = {
  "qwen3.5": { added: QWEN3_5_ADDED, regex: QWEN3_5_SPLIT_REGEX, normalizer: { type: "NFC" } },
  "o200k": { added: O200K_ADDED, regex: O200K_SPLIT_REGEX, normalizer: null },
};

// The text the synthetic vocabulary is learnt from: the kinds of text the checks exercise.
const TRAINING_TEXT = `
The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine; we've seen what you'd do.
Hello, world! How are you doing today? Numbers like 2024, 3.14159 and 1,000,000 are split into digits.
def tokenize(text: str) -> list[int]:
    """Split text into pieces, then merge bytes."""
    return [vocab[piece] for piece in regex.findall(text)]

#include <vector>
int main(int argc, char** argv) { std::vector<int> v{1, 2, 3}; return v.size() > 2 ? 0 : 1; }
SELECT name, count(*) FROM users WHERE created_at >= '2024-01-01' GROUP BY name;
{"role": "assistant", "content": "<think>\\nreasoning\\n</think>\\n\\nanswer", "tool_calls": []}
中文测试：我们正在测试分词器是否与参考实现完全一致。今天天气很好，适合出去散步。人工智能和机器学习。
日本語のテキスト：東京は日本の首都です。ひらがな、カタカナ、漢字が混在しています。ありがとうございます。
한국어 문장도 포함합니다. 안녕하세요! 감사합니다. 오늘 날씨가 좋네요.
Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, как дела?
Ελληνικά: Καλημέρα κόσμε. Ευχαριστώ πολύ.
العربية: مرحبا بالعالم، هذه جملة اختبار للمحلل. شُكْرًا جَزِيلًا.
עברית: שלום עולם, מה שלומך?
हिन्दी: नमस्ते दुनिया, यह एक परीक्षण वाक्य है। धन्यवाद।
ไทย: สวัสดีชาวโลก ขอบคุณมากครับ
Tiếng Việt: Xin chào thế giới, cảm ơn bạn rất nhiều.
Français : déjà vu, où est la bibliothèque ? Ça va très bien, merci.
Deutsch: Größe, Straße, Übergröße, schöne Grüße.
Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🤖🚀✨ 1️⃣
`;

// GPT-2's bytes_to_unicode, as HF's ByteLevel uses it.
function byteToUnicode() {
  const keep = (b) => (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  const map = [];
  let n = 0;
  for (let b = 0; b < 256; ++b) map.push(String.fromCodePoint(keep(b) ? b : 256 + n++));
  return map;
}

function skeleton(vocab, merges, addedFrom, style = BYTE_LEVEL_STYLES["qwen3.5"]) {
  const byteLevel = { type: "ByteLevel", add_prefix_space: false, trim_offsets: false, use_regex: false };
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: style.added.map(([content, special], i) => ({
      id: addedFrom + i, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special,
    })),
    normalizer: style.normalizer,
    pre_tokenizer: {
      type: "Sequence",
      pretokenizers: [
        { type: "Split", pattern: { Regex: style.regex }, behavior: "Isolated", invert: false },
        byteLevel,
      ],
    },
    post_processor: byteLevel,
    decoder: byteLevel,
    model: {
      type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: "", end_of_word_suffix: "",
      fuse_unk: false, byte_fallback: false, ignore_merges: false, vocab, merges,
    },
  };
}

// BPE training: up to numMerges times, the most frequent adjacent pair of symbols (the first seen on
// a tie) over `words` ({syms, count}; a null symbol is a barrier no merge crosses) becomes one
// symbol, handed to onMerge; returns the merges as [a, b] pairs.
function learnMerges(words, numMerges, onMerge) {
  const merges = [];
  while (merges.length < numMerges) {
    const counts = new Map();
    for (const w of words) {
      for (let i = 0; i + 1 < w.syms.length; ++i) {
        if (w.syms[i] === null || w.syms[i + 1] === null) continue;
        const k = w.syms[i] + "\u0000" + w.syms[i + 1];
        counts.set(k, (counts.get(k) || 0) + w.count);
      }
    }
    let best = null, bestCount = 0;
    for (const [k, c] of counts) if (c > bestCount) [best, bestCount] = [k, c];
    if (best === null) break;
    const [a, b] = best.split("\u0000");
    merges.push([a, b]);
    onMerge(a + b);
    for (const w of words) {
      const out = [];
      for (let i = 0; i < w.syms.length; ++i) {
        if (i + 1 < w.syms.length && w.syms[i] === a && w.syms[i + 1] === b) {
          out.push(a + b);
          ++i;
        } else {
          out.push(w.syms[i]);
        }
      }
      w.syms = out;
    }
  }
  return merges;
}

// Byte-level BPE training on HF's own pre-tokenization of `text`.
function makeByteLevel(styleName, outDir, numMerges = 1500) {
  const style = BYTE_LEVEL_STYLES[styleName];
  const alphabet = byteToUnicode();
  const vocab = {};
  alphabet.forEach((c, i) => (vocab[c] = i));
  const bare = Tokenizer.fromString(JSON.stringify(skeleton(vocab, [], 256, style)));
  const pieces = new Map();  // piece -> count
  const text = style.normalizer ? bare.getNormalizer().normalizeString(TRAINING_TEXT) : TRAINING_TEXT;
  for (const [p] of bare.getPreTokenizer().preTokenizeString(text)) {
    pieces.set(p, (pieces.get(p) || 0) + 1);
  }
  const words = [...pieces].map(([p, count]) => ({ syms: [...p], count }));
  const merges = learnMerges(words, numMerges, (m) => (vocab[m] = Object.keys(vocab).length));
  const json = skeleton(vocab, merges, Object.keys(vocab).length, style);
  fs.mkdirSync(outDir, { recursive: true });
  fs.writeFileSync(path.join(outDir, "tokenizer.json"), JSON.stringify(json, null, 2) + "\n");
  Tokenizer.fromFile(path.join(outDir, "tokenizer.json"));  // HF loads it
  console.log(`${outDir}/tokenizer.json: ${Object.keys(vocab).length} vocabulary entries, ` +
              `${merges.length} merges, ${style.added.length} added tokens`);
}

// ---------------------------------------------------------------------------------------------
// SentencePiece-style tokenizers (make-sentencepiece, variants).

const SPACE_MARK = "\u2581";

function isSentencePieceStyle(json) {
  const steps = [];
  const flatten = (c) => (c && c.type === "Sequence" ? c.pretokenizers.forEach(flatten) : steps.push(c));
  flatten(json.pre_tokenizer);
  return !steps.some((s) => s && s.type === "ByteLevel");
}

const byteToken = (b) => `<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`;
const runs = (s, from, to) => Array.from({ length: to - from + 1 }, (_, k) => s.repeat(from + k));

// Added tokens as [content, special]: `head` take the first ids (in the vocabulary too), `tail`
// come after the learnt vocabulary (in it too), `beyond` after that (added tokens only).
const MISTRAL_HEAD = [
  ["<unk>", true], ["<s>", true], ["</s>", true], ["[INST]", true], ["[/INST]", true], ["[TOOL_CALLS]", true],
  ["[AVAILABLE_TOOLS]", true], ["[/AVAILABLE_TOOLS]", true], ["[TOOL_RESULTS]", true], ["[/TOOL_RESULTS]", true],
  ["[control_8]", true], ["[control_9]", true], ["[control_10]", true],
];
const GEMMA3_HEAD = [
  ["<pad>", true], ["<eos>", true], ["<bos>", true], ["<unk>", true], ["<mask>", false], ["[multimodal]", false],
  ["<unused0>", false], ["<unused1>", false], ["<start_of_turn>", true], ["<end_of_turn>", true],
  ...runs("\n", 1, 31).map((c) => [c, false]), ...runs(SPACE_MARK, 2, 31).map((c) => [c, false]),
  ...["<table>", "</table>", "<tr>", "</tr>", "<td>", "</td>", "<b>", "</b>", "<s>", "</s>", "<code>", "</code>"]
    .map((c) => [c, false]),
];
const LLAMA_DECODER = {
  type: "Sequence",
  decoders: [
    { type: "Replace", pattern: { String: SPACE_MARK }, content: " " }, { type: "ByteFallback" }, { type: "Fuse" },
    { type: "Strip", content: " ", start: 1, stop: 0 },
  ],
};
const STYLES = {
  mistral: {
    head: MISTRAL_HEAD, tail: [], beyond: [], bos: "<s>", legacyMerges: true, ignoreMerges: undefined,
    normalizer: {
      type: "Sequence",
      normalizers: [{ type: "Prepend", prepend: SPACE_MARK }, { type: "Replace", pattern: { String: " " }, content: SPACE_MARK }],
    },
    pre_tokenizer: null, decoder: LLAMA_DECODER,
  },
  metaspace: {
    head: MISTRAL_HEAD.slice(0, 3), tail: [], beyond: [], bos: "<s>", legacyMerges: false, ignoreMerges: false,
    normalizer: null,
    pre_tokenizer: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "first", split: false },
    decoder: LLAMA_DECODER,
  },
  gemma3: {
    head: GEMMA3_HEAD, tail: [...runs("\t", 1, 31).map((c) => [c, false]), ["<start_of_image>", true], ["<end_of_image>", true]],
    beyond: [["<image_soft_token>", true]], bos: "<bos>", legacyMerges: false, ignoreMerges: false,
    normalizer: { type: "Replace", pattern: { String: " " }, content: SPACE_MARK },
    pre_tokenizer: { type: "Split", pattern: { String: " " }, behavior: "MergedWithPrevious", invert: false },
    decoder: {
      type: "Sequence",
      decoders: [{ type: "Replace", pattern: { String: SPACE_MARK }, content: " " }, { type: "ByteFallback" }, { type: "Fuse" }],
    },
  },
};

function sentencePieceJson(style, vocab, merges, added) {
  const bosId = vocab[style.bos];
  const bos = (typeId) => ({ SpecialToken: { id: style.bos, type_id: typeId } });
  const model = {
    type: "BPE", dropout: null, unk_token: "<unk>", continuing_subword_prefix: null, end_of_word_suffix: null,
    fuse_unk: true, byte_fallback: true,
  };
  if (style.ignoreMerges !== undefined) model.ignore_merges = style.ignoreMerges;
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: added.map(([content, special, id]) => ({
      id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special,
    })),
    normalizer: style.normalizer,
    pre_tokenizer: style.pre_tokenizer,
    post_processor: {
      type: "TemplateProcessing",
      single: [bos(0), { Sequence: { id: "A", type_id: 0 } }],
      pair: [bos(0), { Sequence: { id: "A", type_id: 0 } }, bos(1), { Sequence: { id: "B", type_id: 1 } }],
      special_tokens: { [style.bos]: { id: style.bos, ids: [bosId], tokens: [style.bos] } },
    },
    decoder: style.decoder,
    model: { ...model, vocab, merges: style.legacyMerges ? merges.map(([a, b]) => `${a} ${b}`) : merges },
  };
}

// Character BPE trained within ▁-words of the style's own normalization of TRAINING_TEXT.
function makeSentencePiece(styleName, outDir, numMerges = 800, minCount = 3) {
  const style = STYLES[styleName];
  if (!style) throw new Error(`unknown style ${styleName} (${Object.keys(STYLES).join(", ")})`);
  const vocab = {};
  const added = [];
  const addEntry = (token) => {
    if (!(token in vocab)) vocab[token] = Object.keys(vocab).length;
    return vocab[token];
  };
  for (const [content, special] of style.head) added.push([content, special, addEntry(content)]);
  for (let b = 0; b < 256; ++b) addEntry(byteToken(b));
  const bare = Tokenizer.fromString(JSON.stringify(sentencePieceJson(style, { ...vocab }, [], added)));
  const normalized = bare.getNormalizer() ? bare.getNormalizer().normalizeString(TRAINING_TEXT) : TRAINING_TEXT;
  const pieces = bare.getPreTokenizer() ? bare.getPreTokenizer().preTokenizeString(normalized).map(([p]) => p)
                                        : [normalized];
  const charCount = new Map();
  for (const p of pieces) for (const c of p) charCount.set(c, (charCount.get(c) || 0) + 1);
  const alphabet = [...charCount].filter(([, n]) => n >= minCount)
    .sort((x, y) => y[1] - x[1] || x[0].codePointAt(0) - y[0].codePointAt(0)).map(([c]) => c);
  alphabet.forEach(addEntry);
  const known = new Set(alphabet);
  const wordCount = new Map();
  for (const p of pieces) {
    for (const w of p.split(new RegExp(`(?=${SPACE_MARK})`, "u"))) if (w) wordCount.set(w, (wordCount.get(w) || 0) + 1);
  }
  // A character outside the alphabet is a barrier no merge crosses.
  const words = [...wordCount].map(([w, count]) => ({ syms: [...w].map((c) => (known.has(c) ? c : null)), count }));
  const merges = learnMerges(words, numMerges, addEntry);
  for (const [content, special] of style.tail) added.push([content, special, addEntry(content)]);
  let next = Object.keys(vocab).length;
  for (const [content, special] of style.beyond) added.push([content, special, next++]);
  const json = sentencePieceJson(style, vocab, merges, added);
  fs.mkdirSync(outDir, { recursive: true });
  fs.writeFileSync(path.join(outDir, "tokenizer.json"), JSON.stringify(json, null, 1) + "\n");
  Tokenizer.fromFile(path.join(outDir, "tokenizer.json"));  // HF loads it
  console.log(`${outDir}/tokenizer.json (${styleName}): ${Object.keys(vocab).length} vocabulary entries ` +
              `(${alphabet.length} characters), ${merges.length} merges, ${added.length} added tokens`);
}

// HF's view of one document for a SentencePiece-style tokenizer: ids, start offsets (code points),
// decode, and what add_special_tokens=true puts around the ids.
async function hfSentencePiece(tokenizer, doc) {
  const e = await tokenizer.encode(doc, null, { addSpecialTokens: false });
  const ids = e.getIds();
  const all = (await tokenizer.encode(doc, null, { addSpecialTokens: true })).getIds();
  let at = 0;
  while (at + ids.length <= all.length && ids.some((id, k) => all[at + k] !== id)) ++at;
  if (at + ids.length > all.length) throw new Error("add_special_tokens=true does not contain the ids");
  return {
    ids, starts: e.getOffsets().map(([s]) => s), decoded: await tokenizer.decode(ids, false),
    before: all.slice(0, at), after: all.slice(at + ids.length),
  };
}

// Variants of a SentencePiece-style tokenizer.json: each replaces top-level fields (model fields merged).
// What the fuzz documents mix in for SentencePiece-style tokenizers.
const SP_FUZZ_PIECES = [SPACE_MARK, SPACE_MARK + SPACE_MARK, " " + SPACE_MARK, "<0x41>", "<0xE4>", "<s>", "</s>", "<unk>",
                        "<bos>", "<start_of_turn>", "\n\n\n", "\t\t", "[INST]", "[/INST]"];

const VARIANTS = [
  ["metaspace-always-split", {
    pre_tokenizer: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "always", split: true },
    decoder: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "always", split: true } }],
  ["metaspace-never-split", {
    pre_tokenizer: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "never", split: true },
    decoder: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "never", split: true } }],
  ["split-then-metaspace-first", {
    pre_tokenizer: { type: "Sequence", pretokenizers: [
      { type: "Split", pattern: { String: "." }, behavior: "Isolated", invert: false },
      { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "first", split: true }] } }],
  ...["Removed", "MergedWithNext", "MergedWithPrevious", "Contiguous"].map((behavior) => [`split-${behavior}`, {
    normalizer: { type: "Replace", pattern: { String: " " }, content: SPACE_MARK },
    pre_tokenizer: { type: "Split", pattern: { String: SPACE_MARK }, behavior, invert: false } }]),
  ["split-invert", {
    normalizer: { type: "Sequence", normalizers: [{ type: "Replace", pattern: { String: " " }, content: SPACE_MARK },
                                                  { type: "Replace", pattern: { String: "e" }, content: "ee" }] },
    pre_tokenizer: { type: "Split", pattern: { String: "ee" }, behavior: "Isolated", invert: true } }],
  ["unk-fused", { model: { byte_fallback: false, fuse_unk: true } }],
  ["unk-unfused", { model: { byte_fallback: false, fuse_unk: false } }],
  ["no-unk", { model: { byte_fallback: false, unk_token: null } }],
  ["ignore-merges", { model: { ignore_merges: true },
    pre_tokenizer: { type: "Metaspace", replacement: SPACE_MARK, prepend_scheme: "always", split: true } }],
  ["no-decoder", { decoder: null }],
  // Strip per token, before Fuse (HF panics where the two cuts cross, so they come one at a time).
  ["strip-per-token", { decoder: { type: "Sequence", decoders: [
    { type: "Replace", pattern: { String: SPACE_MARK }, content: " " }, { type: "Strip", content: " ", start: 0, stop: 1 },
    { type: "Strip", content: " ", start: 2, stop: 0 }, { type: "ByteFallback" }, { type: "Fuse" }] } }],
];

async function variants(tokenizerPath, corpus, out) {
  const base = JSON.parse(fs.readFileSync(tokenizerPath, "utf8"));
  const docs = readCorpus(corpus);
  const lines = [];
  for (const [name, patch] of VARIANTS) {
    const json = { ...base, ...patch, model: { ...base.model, ...(patch.model || {}) } };
    const tokenizer = Tokenizer.fromString(JSON.stringify(json));
    const results = [];
    for (const d of docs) {
      const ids = (await tokenizer.encode(d, null, { addSpecialTokens: false })).getIds();
      results.push({ ids, decoded: await tokenizer.decode(ids, false) });
    }
    lines.push(JSON.stringify({ name, patch, docs: results }));
  }
  fs.writeFileSync(out, lines.join("\n") + "\n");
  console.log(`${out}: ${VARIANTS.length} variants x ${docs.length} documents`);
}

function readCorpus(file) {
  return fs.readFileSync(file, "utf8").split("\n").filter((l) => l.length).map((l) => {
    const d = JSON.parse(l);
    // HF only ever sees text: bytes go in decoded with errors="replace", as Python's callers do.
    return d.text ?? new TextDecoder("utf-8", { fatal: false }).decode(Buffer.from(d.hex, "hex"));
  });
}

async function hfIds(tokenizer, docs) {
  const out = [];
  for (const d of docs) out.push((await tokenizer.encode(d, null, { addSpecialTokens: false })).getIds());
  return out;
}

// Deterministic PRNG (mulberry32).
function rng(seed) {
  return () => {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Every scalar value, 256 per document, each in the contexts the split regex tells apart.
function sweepDocs() {
  const contexts = ["a%a", " %", "%%", ".%", "1%1", "'%", "%'s", "\n%", "%\n", " %a", "a %", "%\u0301", "\u0301%"];
  const docs = [];
  for (let base = 0; base < 0x110000; base += 256) {
    let text = "";
    for (let cp = base; cp < base + 256; ++cp) {
      if (cp >= 0xd800 && cp <= 0xdfff) continue;
      const c = String.fromCodePoint(cp);
      for (const ctx of contexts) text += ctx.replaceAll("%", c) + "|";
    }
    docs.push(text);
  }
  return docs;
}

// Random documents over the scripts and characters that stress the regex and NFC; `extraPieces`
// (SentencePiece-style tokenizers: ▁, <0xNN> spelt out, their added tokens) join the mixed-in pieces.
function fuzzDocs(n, seed, extraPieces = []) {
  const rand = rng(seed);
  const ranges = [
    [0x20, 0x7e], [0xa0, 0x24f], [0x300, 0x36f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x5ff], [0x600, 0x6ff],
    [0x900, 0x97f], [0xe00, 0xe7f], [0x1100, 0x11ff], [0x1ab0, 0x1aff], [0x1dc0, 0x1dff], [0x2000, 0x206f],
    [0x20d0, 0x20ff], [0x3000, 0x30ff], [0x4e00, 0x4eff], [0xac00, 0xacff], [0xfe00, 0xfe0f], [0xfe20, 0xfe2f],
    [0xff00, 0xffef], [0x1f300, 0x1f6ff], [0x1f900, 0x1f9ff], [0xe0100, 0xe01ef],
  ];
  const pieces = ["'s", "'S", "'ll", "'LL", "'re", "'ve", "'d", "'m", "'t", " ", "  ", "\n", "\r\n", "\t", "123",
                  "\u200d", "\ufe0f", "<|im_start|>", "<think>", "</think>", ...extraPieces];
  const docs = [];
  for (let i = 0; i < n; ++i) {
    let text = "";
    const len = 1 + Math.floor(rand() * 200);
    for (let k = 0; k < len; ++k) {
      if (rand() < 0.2) {
        text += pieces[Math.floor(rand() * pieces.length)];
      } else {
        const [lo, hi] = ranges[Math.floor(rand() * ranges.length)];
        text += String.fromCodePoint(lo + Math.floor(rand() * (hi - lo + 1)));
      }
    }
    docs.push(text);
  }
  return docs;
}

// tok_bench's --out / --pieces files: per document a uint32 count, then that many uint32.
function readLists(file) {
  const buf = fs.readFileSync(file);
  const lists = [];
  for (let off = 0; off < buf.length;) {
    const n = buf.readUInt32LE(off);
    const v = [];
    for (let k = 0; k < n; ++k) v.push(buf.readUInt32LE(off + 4 + 4 * k));
    lists.push(v);
    off += 4 + 4 * n;
  }
  return lists;
}

// Index of the first difference of two arrays, -1 when equal.
function firstDifference(a, b) {
  let k = 0;
  while (k < a.length && k < b.length && a[k] === b[k]) ++k;
  return k === a.length && k === b.length ? -1 : k;
}

// Code point index of each UTF-8 byte offset of `text` (and of its end).
function codePointIndexOfByte(text) {
  const index = [];
  let k = 0;
  for (const c of text) {
    for (let b = 0; b < Buffer.byteLength(c); ++b) index.push(k);
    ++k;
  }
  index.push(k);
  return index;
}

async function compare(tokenizerPath, tokBench, args) {
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const sentencePiece = isSentencePieceStyle(JSON.parse(fs.readFileSync(tokenizerPath, "utf8")));
  const sets = [];
  for (let i = 0; i < args.length; ++i) {
    if (args[i] === "--sweep") sets.push(["sweep", sweepDocs()]);
    else if (args[i] === "--fuzz") sets.push(["fuzz", fuzzDocs(Number(args[++i]), 7, sentencePiece ? SP_FUZZ_PIECES : [])]);
    else sets.push([args[i], readCorpus(args[i])]);
  }
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "npm-tok-check-"));
  let failures = 0;
  for (const [name, docs] of sets) {
    const corpus = path.join(tmp, "corpus.jsonl");
    fs.writeFileSync(corpus, docs.map((d) => JSON.stringify({ text: d })).join("\n") + "\n");
    const ids = path.join(tmp, "ids.bin");
    const pieces = path.join(tmp, "pieces.bin");
    const starts = path.join(tmp, "starts.bin"), decoded = path.join(tmp, "decoded.jsonl");
    execFileSync(tokBench, ["--tokenizer", tokenizerPath, "--corpus", corpus, "--threads", "2", "--repeat", "1",
                            "--out", ids, "--pieces", pieces,
                            ...(sentencePiece ? ["--starts", starts, "--decoded", decoded] : [])]);
    const oursIds = readLists(ids), oursPieces = readLists(pieces);
    const oursStarts = sentencePiece ? readLists(starts) : [];
    const oursDecoded = sentencePiece ? readCorpus(decoded) : [];
    const hf = await hfIds(tokenizer, docs);
    // HF's pieces as byte lengths (byte-level: its pre-tokenizer returns them in the byte-level
    // alphabet, one character per byte), after its normalizer, without added-token matching, as
    // tok_bench does; with no pre-tokenizer, the normalized text is the one piece.
    const pre = tokenizer.getPreTokenizer(), norm = tokenizer.getNormalizer();
    const pieceLength = sentencePiece ? (p) => Buffer.byteLength(p) : (p) => [...p].length;
    let bad = 0, badPieces = 0, badStarts = 0, badDecoded = 0, tokens = 0, nPieces = 0;
    for (let i = 0; i < docs.length; ++i) {
      tokens += hf[i].length;
      const a = oursIds[i] || [], b = hf[i];
      const normalized = norm ? norm.normalizeString(docs[i]) : docs[i];
      const hfPieces = (pre ? pre.preTokenizeString(normalized).map(([p]) => p) : normalized ? [normalized] : [])
        .map(pieceLength);
      nPieces += hfPieces.length;
      if (sentencePiece && firstDifference(a, b) < 0) {
        const e = await tokenizer.encode(docs[i], null, { addSpecialTokens: false });
        const cp = codePointIndexOfByte(docs[i]);
        const ks = firstDifference((oursStarts[i] || []).map((o) => cp[o]), e.getOffsets().map(([o]) => o));
        const hfDecoded = await tokenizer.decode(b, false);
        if (ks >= 0) ++badStarts;
        if (oursDecoded[i] !== hfDecoded) ++badDecoded;
        if ((ks >= 0 || oursDecoded[i] !== hfDecoded) && badStarts + badDecoded <= 10) {
          console.log(`${name} document ${i}: ` + (ks >= 0 ? `token ${ks} starts at another offset; ` : "") +
                      (oursDecoded[i] !== hfDecoded ? `decoded ${JSON.stringify(oursDecoded[i].slice(0, 80))} ` +
                                                     `HF ${JSON.stringify(hfDecoded.slice(0, 80))}` : ""));
        }
      }
      const k = firstDifference(a, b), kp = firstDifference(oursPieces[i] || [], hfPieces);
      if (k < 0 && kp < 0) continue;
      if (k >= 0) ++bad;
      if (kp >= 0) ++badPieces;
      if (bad + badPieces <= 10) {
        const at = [...Buffer.from(norm ? norm.normalizeString(docs[i]) : docs[i])];
        const offset = hfPieces.slice(0, Math.max(0, kp)).reduce((x, y) => x + y, 0);
        const around = Buffer.from(at.slice(Math.max(0, offset - 8), offset + 16)).toString("utf8");
        console.log(`${name} document ${i}: ` +
                    (k >= 0 ? `ids differ from token ${k} (ours ${JSON.stringify(a.slice(k, k + 3))} HF ` +
                              `${JSON.stringify(b.slice(k, k + 3))}); ` : "") +
                    (kp >= 0 ? `pieces differ from piece ${kp} (ours ${JSON.stringify((oursPieces[i] || []).slice(kp, kp + 3))} ` +
                               `bytes, HF ${JSON.stringify(hfPieces.slice(kp, kp + 3))}) around ${JSON.stringify(around)}` : ""));
      }
    }
    console.log(`${name}: ${docs.length} documents, ${tokens} HF tokens, ${nPieces} HF pieces; ` +
                `${bad} with other ids, ${badPieces} with other pieces` +
                (sentencePiece ? `, ${badStarts} with other token starts, ${badDecoded} decoded otherwise` : ""));
    failures += bad + badPieces + badStarts + badDecoded;
  }
  fs.rmSync(tmp, { recursive: true });
  return failures;
}

const [cmd, ...rest] = process.argv.slice(2);
if (cmd === "make-qwen3.5") {
  makeByteLevel("qwen3.5", rest[0]);
} else if (cmd === "make-o200k") {
  makeByteLevel("o200k", rest[0]);
} else if (cmd === "make-sentencepiece") {
  makeSentencePiece(rest[0], rest[1]);
} else if (cmd === "expected") {
  const [tok, corpus, out] = rest;
  const tokenizer = Tokenizer.fromFile(tok), docs = readCorpus(corpus);
  const lines = [];
  if (isSentencePieceStyle(JSON.parse(fs.readFileSync(tok, "utf8")))) {
    for (const d of docs) lines.push(await hfSentencePiece(tokenizer, d));
  } else {
    for (const ids of await hfIds(tokenizer, docs)) lines.push({ ids });
  }
  fs.writeFileSync(out, lines.map((l) => JSON.stringify(l)).join("\n") + "\n");
  console.log(`${out}: ${lines.length} documents`);
} else if (cmd === "variants") {
  await variants(rest[0], rest[1], rest[2]);
} else if (cmd === "add-ids") {
  // Each {"text": ...} line of a JSONL file gets HF's "ids" of its text (lines without text, such
  // as a template's {"error": ...}, are kept as they are).
  const [tok, file] = rest;
  const tokenizer = Tokenizer.fromFile(tok);
  const lines = fs.readFileSync(file, "utf8").split("\n").filter((l) => l.length).map(JSON.parse);
  for (const l of lines) {
    if (typeof l.text === "string") l.ids = (await tokenizer.encode(l.text, null, { addSpecialTokens: false })).getIds();
  }
  fs.writeFileSync(file, lines.map((l) => JSON.stringify(l)).join("\n") + "\n");
  console.log(`${file}: ids for ${lines.filter((l) => l.ids).length} of ${lines.length} lines`);
} else if (cmd === "compare") {
  process.exit((await compare(rest[0], rest[1], rest.slice(2))) ? 1 : 0);
} else {
  console.error("usage: make-qwen3.5 DIR | make-o200k DIR | make-sentencepiece STYLE DIR | expected TOKENIZER CORPUS OUT | " +
                "variants TOKENIZER CORPUS OUT | add-ids TOKENIZER JSONL | " +
                "compare TOKENIZER TOK_BENCH [--sweep] [--fuzz N] [CORPUS...]");
  process.exit(2);
}
