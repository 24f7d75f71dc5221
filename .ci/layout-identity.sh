#!/bin/bash
# Did a change of layout change any study's output? Run every study of `python -m pagedbench.bench` at two
# commits (each in its own worktree with its own .venv), one side after the other, on small configs, and
# compare the records with bench/common/record_diff.py. Results: .ci/layout-identity.md.
#   .ci/layout-identity.sh configs              # write the trimmed configs (from PRE's bench/configs)
#   .ci/layout-identity.sh run pre|post [extra] # every study of one side into $OUT/<side>
#   .ci/layout-identity.sh compare [extra]      # record_diff every pair
set -u
PRE=${PRE:-/work/wt-pre}; POST=${POST:-/work/wt-post}; OUT=${OUT:-/tmp/layout_out}; CFG=${CFG:-/tmp/layout_cfg}
DIFF_PY=${DIFF_PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}

configs() {  # one setting, one dataset, one seed, short spans: the same file for both sides
  mkdir -p "$CFG" && "$PRE/.venv/bin/python" - "$PRE" "$POST" "$CFG" <<'PY'
import sys, yaml
pre, post, cfg = sys.argv[1:]
def load(side, name):
    return yaml.safe_load(open(f"{side}/bench/configs/{name}.yaml"))
for name in ("serving", "memory", "host_cost", "calibrate", "kernels", "throughput", "models"):
    assert load(pre, name) == load(post, name), f"{name}.yaml differs between the sides"
s = load(pre, "serving"); s.pop("full")
s.update(settings=[dict(s["settings"][0], span_s=60)], datasets=[{"name": "sharegpt", "dataset": "sharegpt"}],
         seeds=[0], max_seeds=1, span_s=60, min_window_arrivals=0, capacity_resolution=None, bisection_steps=2,
         low_load_requests=20, memory_points=[{"dataset": "sharegpt", "rate": 2.0, "policy": "separate"}],
         sensitivity=dict(s["sensitivity"], factors=[2.0], terms=["step_overhead"]), workers=1)
yaml.safe_dump(s, open(f"{cfg}/serving_small.yaml", "w"), sort_keys=False)
m = load(pre, "memory"); m.pop("full")
w = m["workloads"]
m.update(workloads=[dict(w[0], num_requests=200), dict(w[1], num_requests=400), w[2]], block_sizes=[1, 16, 256],
         sharing=dict(m["sharing"], num_requests=100))
yaml.safe_dump(m, open(f"{cfg}/memory_small.yaml", "w"), sort_keys=False)
h = load(pre, "host_cost"); h.pop("full")
h.update(batch=128, decode_steps=8, rounds=1, peer_rounds=1)
yaml.safe_dump(h, open(f"{cfg}/host_cost_small.yaml", "w"), sort_keys=False)
s = load(pre, "serving"); s.pop("full")  # the larger pass: three settings, trace datasets, a cached system prompt
by = {x["name"]: x for x in s["settings"]}
s.update(settings=[dict(by["opt-13b@a100-40gb"], span_s=60), dict(by["llama-3.1-8b@h100"], span_s=30),
                   dict(by["llama-3.1-8b@l4"], span_s=60)],
         datasets=[{"name": "sharegpt+system cached", "dataset": "sharegpt", "shared_prefix_len": 512,
                    "prefix_caching": True, "settings": ["opt-13b@a100-40gb"], "kinds": ["paged"],
                    "policies": ["mixed"]},
                   {"name": "alpaca", "dataset": "alpaca", "settings": ["opt-13b@a100-40gb"], "span_s": 30},
                   {"name": "azure-conv", "trace": "azure-conv", "settings": ["llama-3.1-8b@h100", "llama-3.1-8b@l4"]},
                   {"name": "azure-code", "trace": "azure-code", "settings": ["llama-3.1-8b@l4"]},
                   {"name": "mooncake-conv", "trace": "mooncake-conv", "prefix_caching": True,
                    "settings": ["llama-3.1-8b@h100"]}],
         seeds=[0], max_seeds=1, min_window_arrivals=0, capacity_resolution=None, bisection_steps=1,
         low_load_requests=20, workers=1, policies=["mixed", "separate"], policy_comparison_settings=[],
         memory_points=[{"dataset": "alpaca", "rate": 30.0, "policy": "mixed"}], sensitivity=None,
         precision_settings=None)
yaml.safe_dump(s, open(f"{cfg}/serving_traces.yaml", "w"), sort_keys=False)
PY
}

run_side() {  # $1: pre or post; $2: "extra" for the larger simulator pass (into $OUT/extra-<side>)
  local wt out; [ "$1" = pre ] && wt=$PRE || wt=$POST; out=$OUT/${2:+$2-}$1
  rm -rf "$out"; mkdir -p "$out/logs" "$out/cache_serving" "$out/cache_serve_sim"
  cd "$wt" || exit 1
  export PYTHONSAFEPATH=1 OMP_NUM_THREADS=1 TQDM_DISABLE=1  # fresh point caches: nothing is read back
  export PAGEDBENCH_SERVING_CACHE=$out/cache_serving PAGEDBENCH_SERVE_SIM_CACHE=$out/cache_serve_sim
  study() { local name=$1 t0; shift; t0=$(date +%s)
    timeout 900 "$wt/.venv/bin/python" -m pagedbench.bench "$name" "$@" > "$out/logs/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$out/logs/summary.txt"; }
  if [ "${2:-}" = extra ]; then
    study memory_study --out "$out" --no-plots
    study serving_study --config "$CFG/serving_traces.yaml" --out "$out" --no-plots
    return
  fi
  study costmodel.vidur_fit --out "$out/costmodel"
  study memory_study --config "$CFG/memory_small.yaml" --out "$out" --no-plots
  study serving_study --config "$CFG/serving_small.yaml" --out "$out" --no-plots
  study sim_speed --requests 400 --repeats 1 --out "$out"
  study calibrate --out "$out"
  study calibrate_online --calibration "$out/calibration.json" --no-refit --out "$out"
  study host_cost --config "$CFG/host_cost_small.yaml" --out "$out"
  study kernel_study --out-dir "$out"
  study throughput_study --out "$out"
  study engine_vs_hf --output-len 16 --repetitions 1 --out "$out"
  study batch_invariance --out "$out"
  study load_speed --out "$out"
  study beam_study --quick --out "$out"
  study beam_serving --out "$out" --no-plots
}

compare() {  # $1: "extra" to compare the larger pass
  local pre=$OUT/${1:+$1-}pre post=$OUT/${1:+$1-}post flags a
  local timed='^(calibration|calibration_online|throughput|engine_vs_hf|host_cost|load_speed|batch_invariance|sim_speed)\.'
  cd /tmp || exit 1
  for a in $(cd "$pre" && ls ./*.json ./*.md costmodel/*.json costmodel/*.md 2>/dev/null); do
    a=${a#./}; flags=""; [[ $(basename "$a") =~ $timed ]] && flags="--ignore-timing"
    # verdicts and counts that follow from this machine's clock: a goal met by a measured error, the steps
    # an engine serving in real time happened to take, a measured cost against its target
    case $(basename "$a") in
      calibration.json) flags="$flags --ignore goal_met --ignore validity";;
      calibration_online.json) flags="$flags --ignore goal_met --ignore num_steps"
                               flags="$flags --ignore num_steps_after_idle --ignore num_steps_with_prefill";;
      host_cost.json|engine_vs_hf.json) flags="$flags --ignore verdict";;
    esac
    [ -f "$post/$a" ] || { echo "--- $a: MISSING on post"; continue; }
    echo "--- $a $flags"
    # shellcheck disable=SC2086
    PYTHONSAFEPATH=1 "$DIFF_PY" -m pagedbench.bench.common.record_diff "$pre/$a" "$post/$a" $flags --limit 8 \
      --same "$pre" "$post" --same "$PRE" "$POST"
  done
  for a in $(cd "$post" && ls ./*.json ./*.md costmodel/*.json costmodel/*.md 2>/dev/null); do
    [ -f "$pre/${a#./}" ] || echo "--- ${a#./}: only on post"
  done
}

case ${1:-} in
  configs) configs;;
  run) run_side "$2" "${3:-}";;
  compare) compare "${2:-}";;
  *) sed -n 2,8p "$0"; exit 2;;
esac
