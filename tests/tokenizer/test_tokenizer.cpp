// Unit tests of kvq::Tokenizer on small hand-written tokenizer.json files: the BPE merge order,
// both merge spellings, added-token flags, normalization, split behaviours, invalid UTF-8,
// round trips, and the errors that malformed or unsupported files must raise.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../../src/tokenizer/regex.hpp"
#include "../../src/tokenizer/text.hpp"
#include "kvq/common.hpp"
#include "kvq/tokenizer.hpp"

namespace {

using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

std::string byte_token(std::string_view raw) { return kvq::tok::byte_level_map().to_token(raw); }

// A byte-level tokenizer: the 256 single bytes get ids 0..255 (id = byte value), then each
// merge "a b" (raw text, spelled through the byte map) gets the next id.
json make_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges,
                    json pre_tokenizer = nullptr, json normalizer = nullptr,
                    json added = json::array(), bool pair_merges = false) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_token(std::string(1, static_cast<char>(b)))] = b;
  json merge_list = json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    const auto ta = byte_token(a), tb = byte_token(b);
    if (!vocab.contains(ta + tb)) vocab[ta + tb] = next++;
    if (pair_merges) {
      merge_list.push_back(json::array({ta, tb}));
    } else {
      merge_list.push_back(ta + " " + tb);
    }
  }
  if (pre_tokenizer.is_null()) {
    pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  }
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre_tokenizer},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"unk_token", nullptr}}}};
}

std::unique_ptr<kvq::Tokenizer> load(const json& j) { return kvq::Tokenizer::from_json(j.dump(), "test.json"); }

Ids bytes_of(std::string_view s) {
  Ids ids;
  for (const char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string error_of(const std::string& text, const std::string& label = "bad.json") {
  try {
    kvq::Tokenizer::from_json(text, label);
  } catch (const kvq::Error& e) {
    return e.what();
  }
  return "";
}

TEST(TokenizerByteLevelMap, IsABijectionWithPrintableIdentity) {
  const auto& m = kvq::tok::byte_level_map();
  std::set<char32_t> seen;
  for (int b = 0; b < 256; ++b) {
    seen.insert(m.to_char[b]);
    EXPECT_EQ(m.to_byte[m.to_char[b]], b);
    if (b >= '!' && b <= '~') {
      EXPECT_EQ(m.to_char[b], static_cast<char32_t>(b));
    }
  }
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(m.to_char[' '], U'\u0120');   // "Ġ"
  EXPECT_EQ(m.to_char['\n'], U'\u010A');  // "Ċ"
}

TEST(TokenizerBpe, LowestRankMergesFirst) {
  // "abc": the pair (b,c) has the lower rank, so the result is a + bc, not ab + c.
  const auto tk = load(make_tokenizer({{"b", "c"}, {"a", "b"}}));
  const auto ids = tk->encode("abc");
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0], 'a');
  EXPECT_EQ(tk->token_text(ids[1]), "bc");
}

TEST(TokenizerBpe, LeftmostPairWinsATie) {
  const auto tk = load(make_tokenizer({{"a", "a"}}));
  const auto aa = tk->token_id("aa");
  EXPECT_EQ(tk->encode("aaa"), (Ids{aa, 'a'}));
  EXPECT_EQ(tk->encode("aaaa"), (Ids{aa, aa}));
}

TEST(TokenizerBpe, MergesChainIntoLongerTokens) {
  const auto tk = load(make_tokenizer({{"l", "o"}, {"lo", "w"}, {"e", "r"}, {"low", "er"}}));
  EXPECT_EQ(tk->encode("lower"), (Ids{tk->token_id("lower")}));
  EXPECT_EQ(tk->encode("lowe"), (Ids{tk->token_id("low"), 'e'}));
  // The GPT-2 split puts the space in front of the word, so " lower" merges without it.
  EXPECT_EQ(tk->encode(" lower"), (Ids{' ', tk->token_id("lower")}));
}

TEST(TokenizerBpe, StringAndPairMergesAreEquivalent) {
  const std::vector<std::pair<std::string, std::string>> merges = {
      {" ", "t"}, {"h", "e"}, {" t", "he"}, {"i", "n"}, {"in", "g"}};
  const auto a = load(make_tokenizer(merges, nullptr, nullptr, json::array(), false));
  const auto b = load(make_tokenizer(merges, nullptr, nullptr, json::array(), true));
  for (const char* text : {"the thing", " the singing theme", "nothing in the"}) {
    EXPECT_EQ(a->encode(text), b->encode(text)) << text;
  }
  EXPECT_EQ(a->encode(" the").size(), 1u);
}

TEST(TokenizerBpe, IgnoreMergesTakesWholeWordsFromTheVocab) {
  // With ignore_merges a piece that is a vocabulary token is used as is, even when the merges
  // alone could not build it.
  json j = make_tokenizer({{"a", "b"}});
  j["model"]["vocab"][byte_token("xyz")] = 300;
  EXPECT_EQ(load(j)->encode("xyz"), (Ids{'x', 'y', 'z'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(j)->encode("xyz"), (Ids{300}));
}

TEST(TokenizerPreTokenizer, Gpt2RegexSplitsContractionsDigitsAndSpaces) {
  // A merge across every adjacent pair shows where the pieces end: bytes of one piece merge,
  // bytes of different pieces never do.
  const auto tk = load(make_tokenizer({{"'", "s"}, {"s", " "}, {" ", " "}, {"1", "2"}, {"2", "a"}}));
  EXPECT_EQ(tk->encode("it's"), (Ids{'i', 't', tk->token_id("'s")}));
  EXPECT_EQ(tk->encode("12a"), (Ids{tk->token_id("12"), 'a'}));
  // "a   b": the run of three spaces leaves its last space to the word: "a", "  ", " b".
  EXPECT_EQ(tk->encode("a   b"), (Ids{'a', tk->token_id(byte_token("  ")), ' ', 'b'}));
}

TEST(TokenizerPreTokenizer, WhiteSpaceIsTheUnicodeProperty) {
  // U+0085 (NEL) is White_Space (so "\s+(?!\S)" leaves it alone before "."), U+FEFF is not
  // (so it joins the following punctuation).
  EXPECT_EQ(kvq::tok::rewrite_whitespace_classes(R"(\s+(?!\S)|[^\s\p{L}]\\s\Q\s\E)"),
            R"(\p{White_Space}+(?!\P{White_Space})|[^\p{White_Space}\p{L}]\\s\Q\s\E)");
  std::vector<std::pair<std::size_t, std::size_t>> m;
  kvq::tok::Regex re(R"(\s+)");
  re.find_all("a\u0085b\ufeffc\u3000", m);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], (std::pair<std::size_t, std::size_t>{1, 3}));
  EXPECT_EQ(m[1], (std::pair<std::size_t, std::size_t>{8, 11}));
}

json split(const std::string& regex, const std::string& behavior, bool invert = false) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           json::array({{{"type", "Split"},
                         {"pattern", {{"Regex", regex}}},
                         {"behavior", behavior},
                         {"invert", invert}},
                        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
}

TEST(TokenizerPreTokenizer, SplitBehaviours) {
  // Merges for every pair in "a-b-c" let the ids show the pieces.
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"a", "-"}, {"-", "b"}, {"b", "-"}, {"-", "c"}, {"a-", "b"}, {"-b", "-"}};
  auto ids = [&](const std::string& behavior, bool invert = false) {
    return load(make_tokenizer(merges, split("-", behavior, invert)))->encode("a-b-c");
  };
  const auto tk = load(make_tokenizer(merges));
  const auto id = [&](const char* s) { return tk->token_id(byte_token(s)); };
  EXPECT_EQ(ids("Removed"), (Ids{'a', 'b', 'c'}));
  EXPECT_EQ(ids("Isolated"), (Ids{'a', '-', 'b', '-', 'c'}));
  EXPECT_EQ(ids("MergedWithPrevious"), (Ids{id("a-"), id("b-"), 'c'}));
  EXPECT_EQ(ids("MergedWithNext"), (Ids{'a', id("-b"), id("-c")}));
  // Inverted, the letters are the delimiters: removing them leaves the dashes.
  EXPECT_EQ(ids("Removed", true), (Ids{'-', '-'}));
  // Contiguous joins runs of matches: "--" is one piece in "a--b".
  const auto contiguous = load(make_tokenizer({{"-", "-"}}, split("-", "Contiguous")));
  EXPECT_EQ(contiguous->encode("a--b"), (Ids{'a', contiguous->token_id("--"), 'b'}));
  const auto isolated = load(make_tokenizer({{"-", "-"}}, split("-", "Isolated")));
  EXPECT_EQ(isolated->encode("a--b"), (Ids{'a', '-', '-', 'b'}));
}

TEST(TokenizerPreTokenizer, Llama3SplitRegex) {
  // Llama-3's split: digits in groups of at most three, case-insensitive contractions, one
  // leading non-letter glued to a word. Merges that would cross those cuts show where they are.
  const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"3", "4"}, {"1", "2"}, {"12", "3"}, {"4", "5"}, {"'", "M"}, {"$", "x"}};
  const auto tk = load(make_tokenizer(merges, split(llama3, "Isolated")));
  EXPECT_EQ(tk->encode("12345"), (Ids{tk->token_id("123"), tk->token_id("45")}));
  EXPECT_EQ(tk->encode("I'M"), (Ids{'I', tk->token_id("'M")}));
  EXPECT_EQ(tk->encode("$x"), (Ids{tk->token_id("$x")}));
  // Without the split, "12345" is one piece and (3,4) merges first.
  const auto whole = load(make_tokenizer(merges, split("$^", "Isolated")));
  EXPECT_EQ(whole->encode("12345"), (Ids{whole->token_id("12"), whole->token_id("34"), '5'}));
}

TEST(TokenizerPreTokenizer, DigitsAndLiteralSplits) {
  const std::vector<std::pair<std::string, std::string>> merges = {{"1", "2"}, {"2", "3"}, {"x", "y"}};
  json digits = {{"type", "Sequence"},
                 {"pretokenizers",
                  json::array({{{"type", "Digits"}, {"individual_digits", true}},
                               {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  EXPECT_EQ(load(make_tokenizer(merges, digits))->encode("123"), (Ids{'1', '2', '3'}));
  digits["pretokenizers"][0]["individual_digits"] = false;
  const auto grouped = load(make_tokenizer(merges, digits));
  EXPECT_EQ(grouped->encode("123"), (Ids{grouped->token_id("12"), '3'}));
  json literal = split("", "Removed");
  literal["pretokenizers"][0]["pattern"] = {{"String", "y"}};
  EXPECT_EQ(load(make_tokenizer(merges, literal))->encode("xyx"), (Ids{'x', 'x'}));
}

TEST(TokenizerPreTokenizer, AddPrefixSpace) {
  json pre = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const auto tk = load(make_tokenizer({{" ", "h"}, {" h", "i"}}, pre));
  EXPECT_EQ(tk->encode("hi"), (Ids{tk->token_id(byte_token(" hi"))}));
  EXPECT_EQ(tk->encode(" hi"), (Ids{tk->token_id(byte_token(" hi"))}));
}

json added(const std::string& content, int id, bool special, bool lstrip = false,
           bool rstrip = false, bool single_word = false, json normalized = nullptr) {
  json a = {{"id", id},       {"content", content},         {"single_word", single_word},
            {"lstrip", lstrip}, {"rstrip", rstrip},           {"special", special}};
  a["normalized"] = normalized.is_null() ? json(!special) : normalized;
  return a;
}

TEST(TokenizerAddedTokens, MatchedLiterallyLongestFirst) {
  json toks = json::array({added("<s>", 300, true), added("<s>x", 301, true), added("[A]", 302, false)});
  const auto tk = load(make_tokenizer({}, nullptr, nullptr, toks));
  EXPECT_EQ(tk->encode("a<s>b"), (Ids{'a', 300, 'b'}));
  EXPECT_EQ(tk->encode("<s>xy"), (Ids{301, 'y'}));
  EXPECT_EQ(tk->encode("<s<s>"), (Ids{'<', 's', 300}));
  EXPECT_EQ(tk->encode("[A][A]"), (Ids{302, 302}));
  EXPECT_EQ(tk->token_id("<s>"), 300);
  EXPECT_TRUE(tk->is_special(300));
  EXPECT_FALSE(tk->is_special(302));
  EXPECT_FALSE(tk->is_special('a'));
  EXPECT_EQ(tk->token_id("no such token"), -1);
  EXPECT_EQ(tk->vocab_size(), 303);
  EXPECT_EQ(tk->decode({'a', 300, 301}), "a<s><s>x");
}

TEST(TokenizerAddedTokens, LstripRstripAbsorbWhiteSpace) {
  json toks = json::array({added("<m>", 300, true, true, false), added("<r>", 301, true, false, true)});
  const auto tk = load(make_tokenizer({}, nullptr, nullptr, toks));
  EXPECT_EQ(tk->encode("a  <m> b"), (Ids{'a', 300, ' ', 'b'}));
  EXPECT_EQ(tk->encode("a <r>  b"), (Ids{'a', ' ', 301, 'b'}));
}

TEST(TokenizerAddedTokens, SingleWordRefusesMatchesInsideWords) {
  json toks = json::array({added("cat", 300, false, false, false, true)});
  const auto tk = load(make_tokenizer({}, nullptr, nullptr, toks));
  EXPECT_EQ(tk->encode("a cat."), (Ids{'a', ' ', 300, '.'}));
  EXPECT_EQ(tk->encode("concat"), bytes_of("concat"));
  EXPECT_EQ(tk->encode("cats"), bytes_of("cats"));
}

TEST(TokenizerAddedTokens, NormalizedTokensMatchAfterNormalization) {
  // "é" written decomposed (e + U+0301) matches a normalized added token "é" only after NFC;
  // a token with normalized=false is searched for in the raw text and does not match.
  json nfc = {{"type", "NFC"}};
  const std::string decomposed = "e\u0301";
  json toks = json::array({added("\u00e9", 300, false, false, false, false, true)});
  EXPECT_EQ(load(make_tokenizer({}, nullptr, nfc, toks))->encode(decomposed), (Ids{300}));
  toks[0]["normalized"] = false;
  EXPECT_EQ(load(make_tokenizer({}, nullptr, nfc, toks))->encode(decomposed), bytes_of("\u00e9"));
}

TEST(TokenizerNormalizer, NfcComposesBeforeSplitting) {
  json nfc = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}})}};
  const auto tk = load(make_tokenizer({}, nullptr, nfc));
  EXPECT_EQ(tk->encode("cafe\u0301"), bytes_of("caf\u00e9"));
  EXPECT_EQ(tk->decode(tk->encode("cafe\u0301")), "caf\u00e9");
  const auto plain = load(make_tokenizer({}));
  EXPECT_EQ(plain->encode("cafe\u0301"), bytes_of("cafe\u0301"));
  json nfkc = {{"type", "NFKC"}};
  EXPECT_EQ(load(make_tokenizer({}, nullptr, nfkc))->encode("\ufb01"), bytes_of("fi"));
}

TEST(TokenizerInvalidUtf8, FallsBackToBytesAndRoundTrips) {
  const auto tk = load(make_tokenizer({{"a", "b"}, {"\xff", "\xfe"}}));
  const std::string bad = "ab\xff\xfe" "ab\xc3" "(\xed\xa0\x80";
  const auto ids = tk->encode(bad);
  EXPECT_EQ(tk->decode(ids), bad);
  // The invalid run is one piece of raw bytes: its own merges apply inside it.
  EXPECT_EQ(ids[1], tk->token_id(byte_token("\xff\xfe")));
}

TEST(TokenizerRoundTrip, ArbitraryBytes) {
  const auto tk = load(make_tokenizer({{" ", "t"}, {"h", "e"}, {" t", "he"}, {"\xc3", "\xa9"}}));
  EXPECT_TRUE(rc::check("decode(encode(bytes)) == bytes", [&] {
    const auto s = *rc::gen::container<std::string>(rc::gen::arbitrary<char>());
    RC_ASSERT(tk->decode(tk->encode(s)) == s);
  }));
}

TEST(TokenizerRoundTrip, UnicodeText) {
  const auto tk = load(make_tokenizer({{" ", "t"}, {"h", "e"}}));
  EXPECT_TRUE(rc::check("decode(encode(utf8)) == utf8", [&](const std::vector<char32_t>& cps) {
    std::string s;
    for (auto c : cps) {
      c %= 0x110000;
      if (c >= 0xD800 && c < 0xE000) c = 'x';
      kvq::tok::append_utf8(s, c);
    }
    RC_ASSERT(kvq::tok::is_valid_utf8(s));
    RC_ASSERT(tk->decode(tk->encode(s)) == s);
  }));
}

TEST(TokenizerEncode, LongRunsDoNotExhaustTheRegexStack) {
  const auto tk = load(make_tokenizer({{" ", " "}, {"a", "a"}}));
  for (const std::string& s : {std::string(200000, ' '), std::string(200000, 'a'),
                               std::string(100000, '!') + std::string(100000, '\n')}) {
    EXPECT_EQ(tk->decode(tk->encode(s)), s);
  }
}

TEST(TokenizerEncode, ConcurrentCallsAgree) {
  const auto tk = load(make_tokenizer({{" ", "t"}, {"h", "e"}, {" t", "he"}}));
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "the word " + std::to_string(i) + " then\n";
  const auto expected = tk->encode(text);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (auto& g : got) threads.emplace_back([&] { g = tk->encode(text); });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST(TokenizerDecode, RejectsUnknownIds) {
  json j = make_tokenizer({});
  j["added_tokens"] = json::array({added("<x>", 400, true)});
  const auto tk = load(j);
  EXPECT_THROW(tk->decode({-1}), kvq::Error);
  EXPECT_THROW(tk->decode({401}), kvq::Error);
  EXPECT_THROW(tk->decode({300}), kvq::Error);  // a hole between the vocab and <x>
  EXPECT_THROW(tk->token_text(300), kvq::Error);
  EXPECT_EQ(tk->decode({400, 'a'}), "<x>a");
  EXPECT_EQ(tk->token_text(' '), "\u0120");
}

TEST(TokenizerErrors, MalformedJsonNamesTheFile) {
  const auto msg = error_of("{\"model\": ", "some/tokenizer.json");
  EXPECT_NE(msg.find("some/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
  EXPECT_NE(error_of("").find("malformed JSON"), std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("object"), std::string::npos);
}

TEST(TokenizerErrors, LoadMissingFile) {
  try {
    kvq::Tokenizer::load("/nonexistent/tokenizer.json");
    FAIL() << "no error";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.json"), std::string::npos);
  }
}

TEST(TokenizerErrors, UnsupportedParts) {
  struct Case {
    std::function<void(json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["model"]["type"] = "WordPiece"; }, "model type 'WordPiece'"},
      {[](json& j) { j["model"].erase("type"); }, "no \"type\""},
      {[](json& j) { j["model"].erase("vocab"); }, "no \"vocab\""},
      {[](json& j) { j["model"]["vocab"] = json::object(); }, "vocab is empty"},
      {[](json& j) { j["model"]["vocab"]["Ġ"] = "x"; }, "id must be an integer"},
      {[](json& j) { j["model"]["vocab"]["zzz"] = 1 << 30; }, "outside"},
      {[](json& j) { j["model"]["vocab"]["zzz"] = 10000000; }, "too sparse"},
      {[](json& j) { j.erase("model"); }, "no \"model\""},
      {[](json& j) { j["model"].erase("merges"); }, "no \"merges\""},
      {[](json& j) { j["model"]["merges"] = json::array({"a"}); }, "merge 0"},
      {[](json& j) { j["model"]["merges"] = json::array({"a b c"}); }, "merge 0"},
      {[](json& j) { j["model"]["merges"] = json::array({json::array({"a", 1})}); }, "merge 0"},
      {[](json& j) { j["model"]["merges"] = json::array({"q r"}); }, "missing from the vocab"},
      {[](json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {[](json& j) { j["model"]["dropout"] = 0.1; }, "dropout"},
      {[](json& j) { j["model"]["unk_token"] = "<unk>"; }, "unk_token"},
      {[](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, "end_of_word_suffix"},
      {[](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, "normalizer type 'Lowercase'"},
      {[](json& j) { j["normalizer"] = {{"type", "Sequence"}}; }, "normalizers"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }, "pre-tokenizer type 'Whitespace'"},
      {[](json& j) { j["pre_tokenizer"] = nullptr; }, "no pre_tokenizer"},
      {[](json& j) { j["pre_tokenizer"] = split("a", "Isolated")["pretokenizers"][0]; }, "no ByteLevel"},
      {[](json& j) {
         j["pre_tokenizer"] = split("a", "Isolated");
         std::swap(j["pre_tokenizer"]["pretokenizers"][0], j["pre_tokenizer"]["pretokenizers"][1]);
       },
       "last step"},
      {[](json& j) { j["pre_tokenizer"] = split("(a", "Isolated"); }, "does not compile"},
      {[](json& j) { j["pre_tokenizer"] = split("a", "Sideways"); }, "behavior"},
      {[](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder type 'WordPiece'"},
      {[](json& j) { j["added_tokens"] = json::array({{{"content", "<x>"}}}); }, "has no id"},
      {[](json& j) { j["added_tokens"] = json::array({{{"id", 5}}}); }, "content"},
      {[](json& j) { j["added_tokens"] = json::array({added("<x>", -3, true)}); }, "outside"},
      {[](json& j) { j["added_tokens"] = 7; }, "must be an array"},
  };
  for (const auto& c : cases) {
    json j = make_tokenizer({{"a", "b"}});
    c.edit(j);
    const auto msg = error_of(j.dump(), "models/x/tokenizer.json");
    EXPECT_NE(msg.find("models/x/tokenizer.json"), std::string::npos) << c.expect << ": " << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << msg;
  }
}

TEST(TokenizerErrors, HostileRegexFailsCleanly) {
  // Catastrophic backtracking must end in kvq::Error (match limit), not hang or crash.
  const auto tk = load(make_tokenizer({}, split("(?:a|aa)+$", "Isolated")));
  EXPECT_THROW(tk->encode(std::string(5000, 'a') + "c"), kvq::Error);
}

}  // namespace
