# Short, uniform target definitions (after abseil's absl_cc_library).
#
#   slidedp_cc_library(NAME foo SRCS a.cc b.cc DEPS bar absl::status)
#   slidedp_cc_binary(NAME slidedp-hostd SRCS main.cc DEPS hostd_lib)
#   slidedp_cc_test(NAME foo_test SRCS foo_test.cc DEPS foo [LABELS slow])
# Library and test names are global; prefix them with their component (state_, adam_, ...).

function(slidedp_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PUBLIC_DEFS" ${ARGN})
  set(has_src FALSE)
  foreach(s IN LISTS A_SRCS)
    if(s MATCHES "\\.(cc|cpp|cu)$")
      set(has_src TRUE)
    endif()
  endforeach()
  if(has_src)
    add_library(${A_NAME} STATIC ${A_SRCS})
    target_link_libraries(${A_NAME} PUBLIC ${A_DEPS})
    if(A_PUBLIC_DEFS)
      target_compile_definitions(${A_NAME} PUBLIC ${A_PUBLIC_DEFS})
    endif()
  else()
    add_library(${A_NAME} INTERFACE)
    target_link_libraries(${A_NAME} INTERFACE ${A_DEPS})
  endif()
endfunction()

function(slidedp_cc_binary)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  set_target_properties(${A_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
endfunction()

# Tests run under ctest; LABELS lets CI pick subsets (e.g. "integration", "gpu").
# Tests labelled gpu (named *_gpu_test) are registered only when SLIDEDP_CUDA is on, fail without a
# GPU, and never run in CI: tools/test.sh passes -LE gpu; a GPU machine runs them with ctest -L gpu.
function(slidedp_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  set_target_properties(${A_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  add_test(NAME ${A_NAME} COMMAND ${A_NAME})
  set_tests_properties(${A_NAME} PROPERTIES TIMEOUT ${A_TIMEOUT}
                       ENVIRONMENT "SLIDEDP_BUILD_DIR=${CMAKE_BINARY_DIR};SLIDEDP_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  if(A_LABELS)
    set_tests_properties(${A_NAME} PROPERTIES LABELS "${A_LABELS}")
  endif()
endfunction()
