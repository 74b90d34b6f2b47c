# Runs `kvq ppl --ctx 2048 --windows 40 --json` on ${MODEL} and passes when the perplexity is
# within 2% of validation_ppl_bf16 in ${MODEL}/training.json (issue 3's acceptance figure).
execute_process(COMMAND ${KVQ} ppl --model ${MODEL} --text ${TEXT} --ctx 2048 --windows 40 --json
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kvq ppl failed (${rc}): ${err}")
endif()
string(JSON ppl GET "${out}" ppl)
string(JSON windows GET "${out}" windows)
file(READ ${MODEL}/training.json training)
string(JSON ref GET "${training}" validation_ppl_bf16)
# |ppl / ref - 1| <= 0.02  <=>  0.98 * ref <= ppl <= 1.02 * ref, evaluated in fixed point (1e-6).
foreach(v ppl ref)
  string(REGEX MATCH "^([0-9]+)\\.?([0-9]*)" m "${${v}}")
  set(int "${CMAKE_MATCH_1}")
  string(SUBSTRING "${CMAKE_MATCH_2}000000" 0 6 frac)
  math(EXPR ${v}_u "${int} * 1000000 + 1${frac} - 1000000")
endforeach()
math(EXPR lo "${ref_u} * 98 / 100")
math(EXPR hi "${ref_u} * 102 / 100")
message(STATUS "ppl ${ppl} over ${windows} windows; bf16 reference ${ref}")
if(NOT windows EQUAL 40 OR ppl_u LESS lo OR ppl_u GREATER hi)
  message(FATAL_ERROR "ppl ${ppl} is not within 2% of ${ref} (or windows ${windows} != 40)")
endif()
