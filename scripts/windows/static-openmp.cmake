# Included before llama.cpp's project() (CMAKE_PROJECT_INCLUDE_BEFORE, set by
# scripts/windows/build_wheel.sh): FindOpenMP takes MinGW's libgomp by the
# full path of its import library (libgomp.dll.a), which -static cannot
# change, so every CPU module would need libgomp-1.dll beside it. Naming
# the static archive here links OpenMP into each module instead.
execute_process(
    COMMAND ${CMAKE_C_COMPILER} -print-file-name=libgomp.a
    OUTPUT_VARIABLE _lloyal_libgomp
    OUTPUT_STRIP_TRAILING_WHITESPACE)
set(OpenMP_gomp_LIBRARY "${_lloyal_libgomp}" CACHE FILEPATH "static libgomp (lloyal)" FORCE)
