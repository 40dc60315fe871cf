// Renders training records of each chat form with a model's own chat template through
// @huggingface/jinja (HF's JavaScript Jinja), applying the record -> messages mapping that
// docs/dataset-format.md ("Input formats") states, written here independently of the C++ one.
// tests/integration/prepare_formats_test.cc compares `slidedp prepare`'s rendered documents with
// this output.
//
//   NODE_PATH=/tmp/jinja-ref/node_modules node tools/chat_template/render_records.mjs \
//       TOKENIZER_CONFIG.json FORMAT RECORDS.jsonl > rendered.jsonl
//
// FORMAT: messages | sharegpt | alpaca | conversational_prompt_completion. Prints one line per
// record, {"text": "..."} or {"error": "..."}.
import fs from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { Template } = require("@huggingface/jinja");

const [configPath, format, recordsPath] = process.argv.slice(2);
if (!recordsPath) {
  console.error("usage: render_records.mjs TOKENIZER_CONFIG.json FORMAT RECORDS.jsonl");
  process.exit(2);
}
const config = JSON.parse(fs.readFileSync(configPath, "utf8"));
const template = new Template(config.chat_template);
const tokenString = (t) => (t && typeof t === "object" ? t.content : t);

// A list of parts is its text parts joined with nothing between them.
function content(c) {
  if (typeof c === "string") return c;
  return c.map((p) => {
    if (p.type !== "text") throw new Error(`part type ${p.type}`);
    return p.text;
  }).join("");
}
const plain = (messages) => messages.map((m) => ({ ...m, content: content(m.content) }));

const SHAREGPT_ROLES = {
  human: "user", user: "user", gpt: "assistant", assistant: "assistant",
  system: "system", tool: "tool", observation: "tool",
};

function messagesOf(r) {
  switch (format) {
    case "messages":
      return plain(r.messages);
    case "sharegpt": {
      const out = r.system ? [{ role: "system", content: r.system }] : [];
      for (const t of r.conversations) {
        const role = SHAREGPT_ROLES[t.from ?? t.role];
        if (!role) throw new Error(`speaker ${t.from ?? t.role}`);
        out.push({ role, content: content(t.value ?? t.content) });
      }
      return out;
    }
    case "alpaca": {
      const out = r.system ? [{ role: "system", content: r.system }] : [];
      out.push({ role: "user", content: [r.instruction, r.input].filter((s) => s).join("\n") });
      out.push({ role: "assistant", content: r.output });
      return out;
    }
    case "conversational_prompt_completion":
      return plain([...r.prompt, ...r.completion]);
    default:
      throw new Error(`format ${format} does not render through a chat template`);
  }
}

const lines = fs.readFileSync(recordsPath, "utf8").split("\n").filter((l) => l.trim());
for (const line of lines) {
  try {
    const text = template.render({
      messages: messagesOf(JSON.parse(line)),
      add_generation_prompt: false,
      bos_token: tokenString(config.bos_token) ?? "",
      eos_token: tokenString(config.eos_token) ?? "",
    });
    console.log(JSON.stringify({ text }));
  } catch (e) {
    console.log(JSON.stringify({ error: e.message }));
  }
}
