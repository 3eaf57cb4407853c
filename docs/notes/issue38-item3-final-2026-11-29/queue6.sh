#!/bin/bash
# the step bound's reference: caching off on the fit and check parts (advise replays it without a
# host tier: host 0 here)
cd "$(dirname "$0")"
while pgrep -f queue5.sh > /dev/null; do sleep 5; done
./run.sh fit_caching_off plain caching-off fit 16 0
./run.sh check_caching_off plain caching-off check 16 0
