#!/usr/bin/env bash
# The CI fuzz smoke run: every target for SECONDS (default 45; 30 to 60 suits CI) in one
# process each. Exits non-zero when a target crashes. See fuzz/README.md.
#
#   fuzz/smoke.sh [SECONDS]
set -euo pipefail
SECONDS_PER_TARGET=${1:-45}
exec "$(dirname "$0")/campaign.sh" "$SECONDS_PER_TARGET" 1
