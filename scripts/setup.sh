#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv in the repository root and install
# sdpa-fusion into it in editable mode with its test and bench extras.
#
# Idempotent and quick on second use: .venv/.sdpa-fusion-stamp records the pyproject.toml,
# extras and CUDA variant it was set up for, and nothing runs while it matches. A .venv
# that already holds every requirement (made by hand, say) is accepted as it is.
#
# `scripts/setup.sh --which-python` prints the interpreter a new venv would be made with.
# Environment: PYTHON=/path/to/python3.12 picks the interpreter; SDPA_FUSION_VENV moves the
# venv; SDPA_FUSION_EXTRAS (default "test,bench"); SDPA_FUSION_CUDA=cu130 installs the CUDA 13
# build of nvFuser over the default CUDA 12.8 one; SDPA_FUSION_CPU_ONLY=1 (the default on a
# machine with no NVIDIA GPU) or 0 chooses the CPU-only install below.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SDPA_FUSION_VENV:-$ROOT/.venv}"
EXTRAS="${SDPA_FUSION_EXTRAS:-test,bench}"
CUDA="${SDPA_FUSION_CUDA:-cu128}"
STAMP="$VENV/.sdpa-fusion-stamp"
CPU_MARK="$VENV/.sdpa-fusion-cpu-only"  # the venv lacks what only a GPU loads (below)

log() { echo "setup: $*" >&2; }

case "$CUDA" in
  cu128) ;;
  cu130) EXTRAS="$EXTRAS,cu130" ;;
  *) log "SDPA_FUSION_CUDA=$CUDA is not known; use cu128 (default) or cu130"; exit 2 ;;
esac

# nvFuser's wheel links against torch's CUDA build, which does not import without the CUDA
# libraries it links to, GPU or not. What only a GPU loads is left out on a machine without
# one: 2.2 GiB of the 7.6 (a CPU-only venv is 5.4 GiB; the test suite needs nothing more).
if [[ -z "${SDPA_FUSION_CPU_ONLY:-}" ]]; then
  SDPA_FUSION_CPU_ONLY=1
  if [[ -e /dev/nvidiactl ]] || command -v nvidia-smi >/dev/null 2>&1; then SDPA_FUSION_CPU_ONLY=0; fi
fi
case "$SDPA_FUSION_CPU_ONLY" in
  0 | 1) ;;
  *) log "SDPA_FUSION_CPU_ONLY=$SDPA_FUSION_CPU_ONLY is not known; use 1 (no GPU) or 0"; exit 2 ;;
esac

# nvFuser wheels exist for CPython 3.12 and 3.10 only.
usable() {
  "$1" -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 12), (3, 10)))' >/dev/null 2>&1
}

pyenv_roots() {
  [[ -n "${PYENV_ROOT:-}" ]] && echo "$PYENV_ROOT"
  echo "$HOME/.pyenv"
  if command -v pyenv >/dev/null 2>&1; then pyenv root 2>/dev/null || true; fi
}

find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    if usable "$PYTHON"; then echo "$PYTHON"; return 0; fi
    log "PYTHON=$PYTHON does not run as Python 3.12 or 3.10"
    return 1
  fi
  local minor candidate root
  for minor in 3.12 3.10; do
    # On PATH, if it really runs (a pyenv shim for a version that is not selected does not).
    if candidate="$(command -v "python$minor" 2>/dev/null)" && usable "$candidate"; then
      echo "$candidate"; return 0
    fi
    # Installed by pyenv, newest patch release first.
    while read -r root; do
      [[ -d "$root/versions" ]] || continue
      for candidate in $(ls -d "$root/versions/$minor".* 2>/dev/null | sort -rV); do
        if usable "$candidate/bin/python$minor"; then echo "$candidate/bin/python$minor"; return 0; fi
      done
    done < <(pyenv_roots | awk '!seen[$0]++')
  done
  log "no Python 3.12 (or 3.10) found: nvFuser wheels exist for CPython 3.10 and 3.12 only."
  log "install one (e.g. 'pyenv install 3.12') or point PYTHON= at it"
  return 1
}

stamp_of() {
  { cat "$ROOT/pyproject.toml"; echo "extras=$EXTRAS cpu_only=$SDPA_FUSION_CPU_ONLY"; } |
    sha256sum | cut -d' ' -f1
}

# Exit 0 when the venv's Python already satisfies every requirement of pyproject.toml
# (dependencies plus the chosen extras); no import of torch, only package metadata.
satisfied() {
  "$VENV/bin/python" - "$ROOT/pyproject.toml" "$EXTRAS" <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
wanted = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    wanted += project["optional-dependencies"][extra]
for line in wanted:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    version = md.version(req.name)  # raises PackageNotFoundError when absent
    if not req.specifier.contains(version, prereleases=True):
        sys.exit(f"{req.name} {version} does not satisfy {line}")
PY
}

pip_install() { "$VENV/bin/python" -m pip install --progress-bar off --no-cache-dir "$@"; }

# The CUDA wheels (torch, nvidia-*, triton, nvFuser) are about 3 GB to download and 8 GB
# installed. One pip call keeps every wheel it downloaded until it ends, so the disk must hold
# both at once; installing them one per call first keeps the peak at the venv plus one wheel.
# No wheel cache either, for the same reason.
#
# CPU-only, pip's plan is installed without what only a GPU loads: triton (torch.compile's GPU
# code generator), cuSOLVER (torch's CUDA linear algebra), NVRTC (torch's runtime compilation;
# nvFuser ships its own) and NVTX; and cuDNN keeps the two libraries that `import torch` and
# `torch.backends.cudnn.version()` open, not its kernels (1 GB, opened by a first cuDNN call on
# a GPU). Every package then goes in with --no-deps, so pip does not add the left-out ones back.
prune_cudnn() {
  "$VENV/bin/python" - <<'PY'
import pathlib
import nvidia.cudnn

lib = pathlib.Path(nvidia.cudnn.__path__[0]) / "lib"
for path in lib.glob("libcudnn_*.so*"):
    if not path.name.startswith("libcudnn_graph."):
        path.unlink()
PY
}

install_staged() {
  local report plan="" kind req light=()
  report="$(mktemp)"
  if pip_install --quiet --dry-run --report "$report" -e "$ROOT[$EXTRAS]" 2>/dev/null; then
    plan="$("$VENV/bin/python" - "$report" "$SDPA_FUSION_CPU_ONLY" <<'PY'
import json
import sys

GPU_ONLY = {"triton", "nvidia-cusolver-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-nvtx-cu12"}
with open(sys.argv[1]) as f:
    report = json.load(f)
cpu_only = sys.argv[2] == "1"
for item in report["install"]:
    name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
    if "dir_info" in item["download_info"]:  # sdpa-fusion itself, from this checkout
        continue
    big = name.startswith(("nvidia-", "nvfuser")) or name in ("torch", "triton")
    if cpu_only and name in GPU_ONLY:
        kind = "skip"
    elif big:
        kind = "heavy"
    else:
        kind = "light"
    print(kind, f"{name}=={version}")
PY
)"
  else
    log "pip could not report its plan (pip older than 22.2?); installing in one call"
    SDPA_FUSION_CPU_ONLY=0
  fi
  rm -f "$report"
  while read -r kind req; do
    case "$kind" in
      heavy)
        log "installing $req on its own ($(df -h --output=avail "$VENV" | tail -1 | tr -d ' ') free)"
        pip_install --quiet --no-deps "$req"
        if [[ "$SDPA_FUSION_CPU_ONLY" == 1 && "$req" == nvidia-cudnn-* ]]; then prune_cudnn; fi ;;
      light) light+=("$req") ;;
      skip) log "leaving out $req (loaded only on a GPU)" ;;
    esac
  done <<< "$plan"
  if [[ "$SDPA_FUSION_CPU_ONLY" == 0 ]]; then
    pip_install -e "$ROOT[$EXTRAS]"
    return
  fi
  if (( ${#light[@]} )); then pip_install --no-deps "${light[@]}"; fi
  pip_install --no-deps -e "$ROOT"
  "$VENV/bin/python" -c "import torch, nvfuser_direct; torch.backends.cudnn.version()"
  touch "$CPU_MARK"
  log "installed for CPU only: what only a GPU loads is left out (SDPA_FUSION_CPU_ONLY=0 adds it)"
}

if [[ "${1:-}" == "--which-python" ]]; then  # the interpreter a new venv would use
  find_python
  exit
fi

want="$(stamp_of)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

if [[ -e "$VENV" ]] && ! usable "$VENV/bin/python"; then
  log "$VENV does not hold a working Python 3.12 or 3.10; recreating it"
  rm -rf "$VENV"
fi
if [[ -e "$CPU_MARK" && "$SDPA_FUSION_CPU_ONLY" == 0 ]]; then
  log "$VENV was set up for CPU only; recreating it with what a GPU loads"
  rm -rf "$VENV"
fi

fresh=0
if [[ ! -e "$VENV" ]]; then
  python="$(find_python)"
  log "creating $VENV with $python ($("$python" --version 2>&1))"
  "$python" -m venv "$VENV"
  fresh=1
fi

if [[ "$fresh" == 0 ]] && satisfied; then
  log "reusing $VENV: every requirement of pyproject.toml ([$EXTRAS]) is installed"
  # the package's own metadata (its command's entry point, its package data) may have changed
  pip_install --quiet --no-deps -e "$ROOT"
else
  size="7.6 GiB"
  [[ "$SDPA_FUSION_CPU_ONLY" == 1 ]] && size="5.4 GiB, CPU only"
  log "installing sdpa-fusion[$EXTRAS] into $VENV (torch and nvFuser are large: $size;" \
      "minutes on first use; $(df -h --output=avail "$(dirname "$VENV")" | tail -1 | tr -d ' ') free)"
  start=$SECONDS
  install_staged
  if [[ "$CUDA" == cu130 ]]; then
    # Both nvFuser builds ship the module nvfuser_direct; make the CUDA 13 one win.
    pip_install --force-reinstall --no-deps nvfuser-cu130-torch210
  fi
  log "installed in $((SECONDS - start)) s"
fi
echo "$want" > "$STAMP"
