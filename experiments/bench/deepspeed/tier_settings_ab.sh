#!/usr/bin/env bash
# The update phase under FileTier settings, one change at a time (issue 20): jax_mlpo all
# principles on one directory, one deepspeed_peer run per setting, settings interleaved over
# rounds, each with its own fio mixed figure. Prints one line per run; JSON per run under $OUT.
#   bash experiments/bench/deepspeed/tier_settings_ab.sh ROUNDS "CHUNK QD SYNC" ...
# e.g. bash experiments/bench/deepspeed/tier_settings_ab.sh 3 "8MiB 8 on" "8MiB 8 off"
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=$1
shift
OUT=${OUT:-/tmp/jax_mlpo-tier-ab}
mkdir -p "$OUT"
for r in $(seq 1 "$rounds"); do
  for setting in "$@"; do
    read -r chunk depth sync <<<"$setting"
    json="$OUT/${chunk}_qd${depth}_sync${sync}_r${r}.json"
    .venv/bin/python -m experiments.bench.deepspeed.deepspeed_peer --state 1GiB \
      --subgroup 8388608 --rounds 1 --steps 3 --systems jax-all-1dir --chunk "$chunk" \
      --queue-depth "$depth" --tier-sync "$sync" --dir /var/tmp/jax_mlpo-tier-ab \
      --json "$json" 2>/dev/null >/dev/null
    .venv/bin/python - "$json" "$setting" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
row = d["rows"]["jax-all-1dir"]
print(f"round {sys.argv[3]} {sys.argv[2]:<14} update {row['update_s']['median']:.2f} s  "
      f"disk {row['disk_gbps']['median']:.2f} GB/s  of mixed limit "
      f"{row['of_mixed_limit']['median']:.2f}")
PY
  done
done
rm -rf /var/tmp/jax_mlpo-tier-ab
