# One helper registers every test binary with CTest.
#   tailserve_add_test(NAME <name> SOURCES <...> LIBS <...> [GPU] [LABELS <...>] [TIMEOUT <s>])
# GPU tests link tests/common's gpu_main, which exits 77 ("skipped") when no CUDA device is present;
# CTest maps that code to "Skipped" so a CPU-only machine reports them honestly instead of as passes.
function(tailserve_add_test)
  cmake_parse_arguments(T "GPU" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ENV" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock)
  if(T_GPU)
    target_link_libraries(${T_NAME} PRIVATE ts_gpu_test_main)
    list(APPEND T_LABELS gpu)
  else()
    target_link_libraries(${T_NAME} PRIVATE GTest::gtest_main)
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} SKIP_RETURN_CODE 77
    ENVIRONMENT "TS_SOURCE_DIR=${PROJECT_SOURCE_DIR};TS_BINARY_DIR=${PROJECT_BINARY_DIR};${T_ENV}")
  if(T_LABELS)
    set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}")
  endif()
endfunction()
