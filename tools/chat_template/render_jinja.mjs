// Renders tests/data/chat_templates/conversations.jsonl with each committed chat template through
// @huggingface/jinja (HF's JavaScript Jinja, the engine of transformers.js), and compares the text
// with the expected files written by hf_render.py (Python transformers' apply_chat_template, the
// oracle); likewise Qwen3.5's own case sets against jinja2_render.py's expected files. A local
// cross-check that needs no GPU machine and no Python transformers:
//
//   mkdir -p /tmp/jinja-ref && (cd /tmp/jinja-ref && npm install @huggingface/jinja@0.5.11)
//   NODE_PATH=/tmp/jinja-ref/node_modules node tools/chat_template/render_jinja.mjs
//
// Known, expected differences, where @huggingface/jinja 0.5.11 is not Python (the script names them
// and does not count them as failures):
// - `trim` is Python's str.strip() in transformers and JS's String.prototype.trim() here; they
//   disagree on U+001C..U+001F and U+0085 (Python strips them) and U+FEFF (JS strips it). The Llama
//   templates trim message contents.
// - `s.lstrip('\n')` / `s.strip('\n')` ignore their argument here and strip all whitespace; Qwen3's
//   template calls them on assistant contents, so a reply starting with a space other than "\n"
//   (U+2003, U+FEFF, ...) differs.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { Template } = require("@huggingface/jinja");
// The package's exports hide its package.json; read it next to the resolved entry point.
const jinjaVersion = JSON.parse(
  fs.readFileSync(path.join(path.dirname(require.resolve("@huggingface/jinja")), "..", "package.json"), "utf8"),
).version;
const here = path.dirname(new URL(import.meta.url).pathname);
const data = path.join(here, "../../tests/data/chat_templates");
const qwen3Config = path.join(here, "../../tests/data/tokenizer/qwen3/tokenizer_config.json");

// The same table as hf_render.py: template name -> tokenizer_config.json holding the template.
const TEMPLATES = {
  "qwen3": qwen3Config,
  "qwen2.5": path.join(data, "qwen2.5-instruct.tokenizer_config.json"),
  "llama3": path.join(data, "llama3/tokenizer_config.json"),
  "llama3.1": path.join(data, "llama3.1-instruct.tokenizer_config.json"),
  "llama3.2": path.join(data, "llama3.2-instruct.tokenizer_config.json"),
};
const PY_JS_TRIM_DIFFER = /[\u001c-\u001f\u0085\ufeff]/;

function tokenString(t) {
  return t && typeof t === "object" ? t.content : t;
}

const cases = fs.readFileSync(path.join(data, "conversations.jsonl"), "utf8").trim().split("\n").map(JSON.parse);
let failures = 0, checked = 0, known = 0;
for (const [name, configPath] of Object.entries(TEMPLATES)) {
  const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
  const template = new Template(config.chat_template);
  const expectedPath = path.join(data, "expected", `${name}.jsonl`);
  const expected = fs.existsSync(expectedPath)
    ? fs.readFileSync(expectedPath, "utf8").trim().split("\n").map(JSON.parse)
    : [];
  cases.forEach((c, i) => {
    const vars = {
      messages: c.messages,
      add_generation_prompt: Boolean(c.add_generation_prompt),
      bos_token: tokenString(config.bos_token) ?? "",
      eos_token: tokenString(config.eos_token) ?? "",
    };
    // Llama 3.2 asks strftime_now for today's date unless date_string is given: slidedp renders
    // "26 Jul 2024" (the template's own fallback) unless told otherwise, so the oracle is given it.
    if (c.date_string) vars.date_string = c.date_string;
    else if (name === "llama3.2") vars.date_string = "26 Jul 2024";
    let text;
    try {
      text = template.render(vars);
    } catch (e) {
      text = `ERROR: ${e.message}`;
    }
    const want = expected.find((e) => e.case === i);
    if (!want) {
      console.log(`${name} case ${i}: no expected text (run hf_render.py)`);
      return;
    }
    ++checked;
    if (text === want.text) return;
    const explained =
      (name.startsWith("llama") && c.messages.some((m) => PY_JS_TRIM_DIFFER.test(m.content))) ||
      (name === "qwen3" && c.messages.some((m) => m.role === "assistant" && /^\n*[^\S\n]|^\n*\ufeff/.test(m.content)));
    if (explained) {
      ++known;
      console.log(`${name} case ${i}: differs, as expected (JS trim/strip vs Python str.strip)`);
    } else {
      ++failures;
      console.log(`${name} case ${i}: DIFFERS\n  jinja: ${JSON.stringify(text)}\n  hf:    ${JSON.stringify(want.text)}`);
    }
  });
}

// Qwen3.5: its own case sets against expected/qwen3.5*.jsonl (Python Jinja2 as transformers runs
// it, jinja2_render.py); a case the template raises on must raise here too. The template trims
// every content and strips "\n" around </think>, so the JS differences above apply to any content
// with a character the two trims disagree on, and to any assistant content holding </think>
// (`lstrip('\n')` strips all whitespace here).
const QWEN3_5 = {
  "qwen3.5": path.join(data, "qwen3.5.tokenizer_config.json"),
  "qwen3.5-nothink": path.join(data, "qwen3.5-nothink.tokenizer_config.json"),
};
const QWEN3_5_SETS = { "": "qwen3.5-conversations.jsonl", ".random": "qwen3.5-random-conversations.jsonl" };
const TRIMS_DIFFER = /[\u001c-\u001f\u0085\ufeff\u180e]/;
const texts = (m) => [m.content, m.reasoning_content].flat().map((x) => (x && typeof x === "object" ? x.text : x))
  .filter((x) => typeof x === "string");
const [checkedBefore, knownBefore, failuresBefore] = [checked, known, failures];
for (const [name, configPath] of Object.entries(QWEN3_5)) {
  const template = new Template(JSON.parse(fs.readFileSync(configPath, "utf8")).chat_template);
  for (const [set, file] of Object.entries(QWEN3_5_SETS)) {
    const cases = fs.readFileSync(path.join(data, file), "utf8").trim().split("\n").map(JSON.parse);
    const expected = fs.readFileSync(path.join(data, "expected", `${name}${set}.jsonl`), "utf8").trim().split("\n")
      .map(JSON.parse);
    cases.forEach((c, i) => {
      let text, error;
      try {
        text = template.render({ messages: c.messages, add_generation_prompt: Boolean(c.add_generation_prompt) });
      } catch (e) {
        error = e.message;
      }
      ++checked;
      const want = expected[i];
      if (want.error !== undefined ? error !== undefined && error.includes(want.error) : text === want.text) return;
      const explained = c.messages.some((m) => texts(m).some((t) => TRIMS_DIFFER.test(t))) ||
        c.messages.some((m) => m.role === "assistant" && texts(m).some((t) => t.includes("</think>")));
      if (explained) {
        ++known;
        if (!set) console.log(`${name} case ${i}: differs, as expected (JS trim/strip vs Python str.strip)`);
      } else {
        ++failures;
        console.log(`${name}${set} case ${i}: DIFFERS\n  jinja: ${JSON.stringify(error ?? text)}\n` +
                    `  hf:    ${JSON.stringify(want.error ?? want.text)}`);
      }
    });
  }
}
const [q35Checked, q35Known, q35Failures] = [checked - checkedBefore, known - knownBefore, failures - failuresBefore];
console.log(`qwen3.5 (both copies): ${q35Checked - q35Known - q35Failures} identical, ${q35Known} known trim ` +
            `differences, ${q35Failures} failed`);

// Gemma 3, GPT-OSS and the Mistral templates (jinja2_render.py --group families): the shared cases,
// families-conversations.jsonl and families-random-conversations.jsonl, with the same inputs as the
// Python oracle (lists joined but for Gemma 3, strftime_now giving the case's date or 2025-08-05).
// A case the template raises on must raise here too; for a Python TypeError (GPT-OSS's
// `"..." in message.thinking` on null) this library may render instead, which is counted as known.
// Known, as above: Gemma 3 and Mistral v3 `trim` contents, so a content with a character the two
// trims disagree on differs. And in this library `selectattr("tool_calls", "undefined")` keeps no
// message (Python keeps those without the key), so the alternation check of Mistral Nemo's first
// copy never fires: where Python raises it, this renders or raises later.
const FAMILIES = ["gemma3", "gpt-oss", "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v3-tekken-first",
                  "mistral-v7"];
const FAMILY_SETS = { "": "conversations.jsonl", ".families": "families-conversations.jsonl",
                      ".families-random": "families-random-conversations.jsonl" };
const TRIMMING = new Set(["gemma3", "mistral-v3"]);
const joinParts = (m) => (Array.isArray(m.content) ? { ...m, content: m.content.map((p) => p.text).join("") } : m);
// This library's strftime_now reads `new Date()` (local time) and cannot be overridden by a
// variable: `Date` is replaced by one whose "now" is noon of the case's date.
const RealDate = Date;
let fixedNow = null;
globalThis.Date = class extends RealDate {
  constructor(...args) {
    super(...(args.length || fixedNow === null ? args : [fixedNow]));
  }
};
const [famChecked, famKnown, famFailures] = [checked, known, failures];
const famReasons = {};
for (const name of FAMILIES) {
  const config = JSON.parse(fs.readFileSync(path.join(data, `${name}.tokenizer_config.json`), "utf8"));
  const template = new Template(config.chat_template);
  for (const [set, file] of Object.entries(FAMILY_SETS)) {
    const cases = fs.readFileSync(path.join(data, file), "utf8").trim().split("\n").map(JSON.parse);
    const expected = fs.readFileSync(path.join(data, "expected", `${name}${set}.jsonl`), "utf8").trim().split("\n")
      .map(JSON.parse);
    cases.forEach((c, i) => {
      const iso = /^\d{4}-\d{2}-\d{2}$/.test(c.date_string ?? "");
      const [y, mo, d] = (iso ? c.date_string : "2025-08-05").split("-").map(Number);
      fixedNow = new RealDate(y, mo - 1, d, 12).getTime();
      const vars = {
        messages: name === "gemma3" ? c.messages : c.messages.map(joinParts),
        add_generation_prompt: Boolean(c.add_generation_prompt),
        bos_token: tokenString(config.bos_token) ?? "",
        eos_token: tokenString(config.eos_token) ?? "",
      };
      let text, error;
      try {
        text = template.render(vars);
      } catch (e) {
        error = e.message;
      }
      ++checked;
      const want = expected[i];
      if (want.error !== undefined ? error !== undefined && (want.error_type || error.includes(want.error))
                                   : text === want.text) return;
      const reason = want.error_type !== undefined ? "a Python error" :
        name === "mistral-v3-tekken-first" && want.error?.startsWith("After the optional system message")
          ? "selectattr" :
        TRIMMING.has(name) && c.messages.some((m) => texts(m).some((t) => TRIMS_DIFFER.test(t))) ? "trim" : null;
      if (reason) {
        ++known;
        famReasons[reason] = (famReasons[reason] ?? 0) + 1;
        if (set !== ".families-random") console.log(`${name}${set} case ${i}: differs, as expected`);
      } else {
        ++failures;
        console.log(`${name}${set} case ${i}: DIFFERS\n  jinja: ${JSON.stringify(error ?? text)}\n` +
                    `  py:    ${JSON.stringify(want.error ?? want.text)}`);
      }
    });
  }
}
console.log(`gemma3, gpt-oss, mistral-*: ${checked - famChecked - (known - famKnown) - (failures - famFailures)} ` +
            `identical, ${known - famKnown} known differences (${JSON.stringify(famReasons)}), ` +
            `${failures - famFailures} failed`);

console.log(`@huggingface/jinja ${jinjaVersion}: ${checked - failures - known} ` +
  `identical, ${known} known differences, ${failures} failed`);
process.exit(failures ? 1 : 0);
