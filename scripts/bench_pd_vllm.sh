#!/usr/bin/env bash
# The mixed P/D fleet on vLLM engines (a stock `vllm serve` kv_producer prefill, a pdserve --engine vllm decode,
# pdserve proxy --mode inline) against one coupled stock vLLM server, in one `pdserve bench serve` run
# (streamed chat, C=1 and C=4). Needs .venv and .venv-vllm (make install, make vllm-env). docs/pd.md has the figures.
#   scripts/bench_pd_vllm.sh [MODEL_DIR] [OUT_DIR]    (default: qwen3-tiny built for vLLM, /tmp/bench-pd-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$(.venv-vllm/bin/python -c 'from pdserve.checkpoints.resolve import resolve_model; print(resolve_model("qwen3-tiny", engine="vllm"))')}
OUT=${2:-/tmp/bench-pd-vllm}
mkdir -p "$OUT"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
PARSERS=(--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice)
COMMON=(--served-model-name qwen3-tiny --max-model-len 2048 --dtype float32)
VLLM=(.venv-vllm/bin/python scripts/vllm_cli.py serve "$MODEL" "${COMMON[@]}" --enforce-eager --enable-scale-out)
pids=()
trap 'kill -- $(printf -- "-%s " "${pids[@]}") 2>/dev/null || true' EXIT
start() { local log=$1; shift; setsid "$@" > "$OUT/$log.log" 2>&1 & pids+=($!); }
PDSERVE_PACE_NIXL=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=5803 start prefill "${VLLM[@]}" \
  --port 8703 --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
start decode .venv-vllm/bin/pdserve serve "$MODEL" "${COMMON[@]}" --engine vllm --kv-transfer nixl --kv-host 127.0.0.1 \
  --kv-role decode --kv-side-channel-port 5802 "${PARSERS[@]}" --port 8702
start coupled "${VLLM[@]}" "${PARSERS[@]}" --port 8705
start render .venv/bin/pdserve launch render --tokenizer "$MODEL" "${PARSERS[@]}" --served-model-name qwen3-tiny --port 8700
for port in 8700 8702 8703 8705; do
  until curl -sf -o /dev/null "localhost:$port/health"; do sleep 3; done
done
.venv/bin/python -c "from pdserve.topology.warmup import hand_off as h; print('warm-up hand-off', h('http://127.0.0.1:8703', 'http://127.0.0.1:8702', 600), 's')"
start proxy .venv/bin/pdserve proxy --render http://127.0.0.1:8700 --prefill http://127.0.0.1:8703 \
  --decode http://127.0.0.1:8702 --mode inline --port 8710
until curl -sf -o /dev/null localhost:8710/health; do sleep 1; done
.venv/bin/pdserve bench serve --base-url http://127.0.0.1:8710 --base-url http://127.0.0.1:8705 --endpoint chat \
  --render-url http://127.0.0.1:8700 --max-concurrency 1,4 --num-prompts 16 --num-warmups 2 --random-input-len 256 \
  --random-output-len 64 --ignore-eos --no-server-cpu --save-result --result-filename "$OUT/result.json" --disable-tqdm
