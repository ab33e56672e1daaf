#!/usr/bin/env bash
# Real-GPU check of both SGLang installers, against a live SGLang 0.5.23 server.
#
# Needs an NVIDIA GPU. Installs sglang into a fresh venv (about 11 GB, 6-7 minutes, needs the
# package registry), unless SGLANG_PYTHON names a Python that already has sglang and this project
# (`pip install -e .`) installed. Then, all on 127.0.0.1:
#   1. writes a tiny random Llama (bf16, sharded safetensors) as the launch snapshot;
#   2. publishes r0 (launch), r1 and r2 (XOR deltas) into a file:// catalog;
#   3. launches SGLang on the launch snapshot with the in-engine loader registered;
#   4. refits r1 with `--installer sglang`, r2 with `--installer sglang-disk`, r1 again with
#      `sglang-disk` (a rollback), and r2 again with `sglang`;
#   5. after each: /model_info (weight_version, model_path) and /get_weights_by_name for a few
#      tensors against the published bytes, and a /generate request.
# Exit 0 only if every check passes. Summary: $OUT/gpu_sglang_check.json (or $WORK/...), server log
# next to it. Knobs: WORK (scratch folder), PORT (default 30123), SGLANG_VERSION (default 0.5.23).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/sglang-check.XXXXXX)}
PORT=${PORT:-30123}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
RESULTS=${OUT:-$WORK}
MODEL=check/tiny
URL=http://127.0.0.1:$PORT
mkdir -p "$WORK" "$RESULTS"
export PREFECT_HOME=$WORK/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export CANONICAL_REFIT_CACHE_DIR=$WORK/cache CANONICAL_REFIT_MODEL=$MODEL  # where the in-engine loader looks
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

PY=${SGLANG_PYTHON:-}
if [ -z "$PY" ]; then
  log "installing sglang==$SGLANG_VERSION and this project into $WORK/venv"
  python3 -m venv "$WORK/venv"
  PY=$WORK/venv/bin/python
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "sglang==$SGLANG_VERSION" -e "$ROOT"
fi
"$PY" -c "import sglang, tasks.installers.sglang_loader; print('sglang', sglang.__version__)" >&2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2

log "writing the launch snapshot and two trained revisions"
"$PY" - "$WORK" <<'EOF'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

work = Path(sys.argv[1])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "launch", max_shard_size="600KB")
previous = work / "launch"
for step in (1, 2):  # an optimizer-step-like perturbation of every tensor
    folder = work / f"step{step}"
    shutil.copytree(previous, folder)
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        gen = torch.Generator().manual_seed(step)
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen) * 1e-2 * (t.float().abs() + 1e-3)
            tensors[name] = (t.float() + noise).to(t.dtype).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    previous = folder
print(json.dumps(sorted(p.name for p in (work / "launch").iterdir())), file=sys.stderr)
EOF

log "publishing r0, r1, r2"
"$PY" -m flows.publish --catalog "$WORK/catalog" --model $MODEL --checkpoint "$WORK/launch" --kind initial \
  --version r0 --state-dir "$WORK/publisher" --no-event --json
for v in 1 2; do
  "$PY" -m flows.publish --catalog "$WORK/catalog" --model $MODEL --checkpoint "$WORK/step$v" --kind delta \
    --version r$v --state-dir "$WORK/publisher" --no-event --json
done

log "launching SGLang on $URL"
"$PY" -m sglang.launch_server --model-path "$WORK/launch" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
  --skip-tokenizer-init --mem-fraction-static 0.3 --cuda-graph-max-bs 4 \
  --custom-weight-loader tasks.installers.sglang_loader.load_prepared_checkpoint >"$RESULTS/sglang_server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  kill -0 $SERVER 2>/dev/null || { tail -50 "$RESULTS/sglang_server.log" >&2; log "server exited"; exit 1; }
  curl -sf --max-time 5 "$URL/health" >/dev/null && break
  sleep 2
done
curl -sf --max-time 5 "$URL/health" >/dev/null || { log "server not healthy after 480s"; exit 1; }
log "server is up"

refit() {  # refit TARGET INSTALLER
  log "refit $1 with --installer $2"
  "$PY" -m flows.refit --catalog "$WORK/catalog" --model $MODEL --cache-dir "$WORK/cache" \
    --seed-checkpoint "$WORK/launch" --target "$1" --installer "$2" --engine-url "$URL" --json \
    | tail -1 >"$WORK/refit-$1-$2.json"
}

check() {  # check VERSION FOLDER INSTALLER EXPECTED_MODEL_PATH: the engine serves exactly VERSION
  "$PY" - "$URL" "$@" "$RESULTS/gpu_sglang_check.jsonl" "$WORK/refit-$1-$3.json" <<'EOF'
import json, sys, time, urllib.request
from pathlib import Path
import numpy as np
from safetensors import safe_open

url, version, folder, installer, model_path, out, refit_json = sys.argv[1:8]

def call(path, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())

def published(name):
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name).float().numpy()
    raise KeyError(name)

result = json.loads(Path(refit_json).read_text())
info = call("/model_info")
checks = {"refit READY": result.get("status") == "READY" and result.get("version") == version,
          "weight_version": info.get("weight_version") == version,
          "model_path": info.get("model_path") == model_path}
for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
    got = np.asarray(call("/get_weights_by_name", {"name": name, "truncate_size": 4}), dtype=np.float32)
    checks[name] = got.shape == published(name)[:4].shape and np.array_equal(got, published(name)[:4])
gen = call("/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
checks["generate"] = bool(gen)
record = {"version": version, "installer": installer, "model_info": {k: info.get(k) for k in
          ("model_path", "weight_version", "load_format")}, "checks": checks,
          "install": next((s for s in result.get("stages", []) if s["name"] == "install"), None),
          "at": time.strftime("%H:%M:%S")}
with open(out, "a") as fh:
    fh.write(json.dumps(record) + "\n")
print(json.dumps(record), file=sys.stderr)
sys.exit(0 if all(checks.values()) else 1)
EOF
}

STABLE=$WORK/cache/check--tiny/current
: >"$RESULTS/gpu_sglang_check.jsonl"
status=0
refit r1 sglang && check r1 "$WORK/step1" sglang "$WORK/launch" || status=1
refit r2 sglang-disk && check r2 "$WORK/step2" sglang-disk "$STABLE" || status=1
refit r1 sglang-disk && check r1 "$WORK/step1" sglang-disk "$STABLE" || status=1
refit r2 sglang && check r2 "$WORK/step2" sglang "$STABLE" || status=1
"$PY" - "$RESULTS" "$status" <<'EOF'
import json, sys
from pathlib import Path
results, status = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(l) for l in (results / "gpu_sglang_check.jsonl").read_text().splitlines() if l.strip()]
summary = {"passed": status == 0 and len(rows) == 4 and all(all(r["checks"].values()) for r in rows), "steps": rows}
(results / "gpu_sglang_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({"passed": summary["passed"], "steps": [(r["version"], r["installer"], all(r["checks"].values()))
                                                         for r in rows]}))
EOF
grep -E "Traceback|Scheduler hit an exception" "$RESULTS/sglang_server.log" >&2 && status=1
log "done: status $status (details in $RESULTS)"
exit $status
