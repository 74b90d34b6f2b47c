# Read by ctest after the gtest-discovered tests of tests/quality: the end-to-end model runs are
# `slow` (CI's sanitizer run skips them; the Release run keeps them).
set_tests_properties(Quality.PrefillSeesTheCacheAsDecodeDoes Quality.EvaluateModelEndToEnd PROPERTIES LABELS slow)
