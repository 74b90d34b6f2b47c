# Read by ctest after the gtest-discovered tests of tests/cache: the every-format sweep is
# `slow` under the sanitizers (CI's sanitizer run skips it; the Release run keeps it).
set_tests_properties(PagedCache.FastEqualsReferenceEveryFormat PROPERTIES LABELS slow)
