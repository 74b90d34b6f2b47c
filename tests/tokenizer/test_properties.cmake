# Read by ctest after the gtest-discovered tests of tests/tokenizer (TEST_INCLUDE_FILES):
# whole-corpus comparisons are `slow` (CI's sanitizer run skips them), and the tests of the real
# tokenizers need the npm fixture that installs them.
set_tests_properties(
  TokenizerTiny.FullCorpus TokenizerQwen3.FullCorpus TokenizerDeepSeekV3.FullCorpus
  PROPERTIES LABELS slow)
set_tests_properties(
  TokenizerQwen3.SamplesAndReducedCorpus TokenizerQwen3.FullCorpus
  TokenizerDeepSeekV3.SamplesAndReducedCorpus TokenizerDeepSeekV3.FullCorpus
  TokenizerDeepSeekV3.SpecialAndAddedTokens
  PROPERTIES FIXTURES_REQUIRED kvq_tokenizer_npm)
