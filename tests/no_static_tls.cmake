# Fails if LIBRARY asks for static TLS (readelf shows STATIC_TLS among its dynamic flags, as any
# initial-exec thread_local makes it do). Such a library cannot be loaded with dlopen into a
# process that has used up glibc's spare static TLS: PyTorch's processes have, and they load
# libgpupool_c that way ("cannot allocate memory in static TLS block").
#   cmake -DREADELF=readelf -DLIBRARY=libgpupool_c.so -P no_static_tls.cmake
execute_process(COMMAND ${READELF} -d ${LIBRARY} OUTPUT_VARIABLE dynamic RESULT_VARIABLE failed)
if(failed)
  message(FATAL_ERROR "${READELF} -d ${LIBRARY} failed")
endif()
if(NOT dynamic MATCHES "\\(FLAGS\\)|\\(FLAGS_1\\)|NEEDED")
  message(FATAL_ERROR "${READELF} -d ${LIBRARY} printed no dynamic section:\n${dynamic}")
endif()
if(dynamic MATCHES "STATIC_TLS")
  message(FATAL_ERROR "${LIBRARY} needs static TLS (an initial-exec thread_local?): it would not "
                      "load with dlopen into PyTorch's processes")
endif()
