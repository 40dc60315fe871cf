#!/usr/bin/env bash
# The GPU suite (docs/gpu-suite.md): the parts are a table, tools/gpu/suite_parts.py, run and judged by
# tools/gpu/run_suite.py; this is the same command under its documented name.
#   tools/gpu/run_suite.sh PART [PART...]     DRY_RUN=1 tools/gpu/run_suite.sh PART     tools/gpu/run_suite.sh --help
exec python3 "$(dirname "$0")/run_suite.py" "$@"
