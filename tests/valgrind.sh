#!/bin/sh
# Runs a test binary under valgrind's memcheck: any error (an uninitialised read, an
# invalid access, a definite leak) fails the test. Skipped (77) without valgrind.
# Usage: valgrind.sh BINARY [ARGS...]
command -v valgrind >/dev/null 2>&1 || { echo "valgrind not found: skipped"; exit 77; }
exec valgrind --tool=memcheck --error-exitcode=1 --track-origins=yes \
  --leak-check=full --errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect \
  "$@"
