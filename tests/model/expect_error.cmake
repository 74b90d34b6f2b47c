# Runs ${KVQ} with ${ARGS} (a ;-list) and passes only if it exits non-zero with a message on
# stderr that starts with "kvq: error:" and contains ${EXPECT}.
execute_process(COMMAND ${KVQ} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "expected a non-zero exit, got 0; stdout: ${out}")
endif()
if(NOT err MATCHES "kvq: error:")
  message(FATAL_ERROR "expected 'kvq: error:' on stderr (exit ${rc}), got: ${err}")
endif()
string(FIND "${err}" "${EXPECT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "expected '${EXPECT}' in the message, got: ${err}")
endif()
message(STATUS "exit ${rc}: ${err}")
