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
# build of nvFuser over the default CUDA 12.8 one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SDPA_FUSION_VENV:-$ROOT/.venv}"
EXTRAS="${SDPA_FUSION_EXTRAS:-test,bench}"
CUDA="${SDPA_FUSION_CUDA:-cu128}"
STAMP="$VENV/.sdpa-fusion-stamp"

log() { echo "setup: $*" >&2; }

case "$CUDA" in
  cu128) ;;
  cu130) EXTRAS="$EXTRAS,cu130" ;;
  *) log "SDPA_FUSION_CUDA=$CUDA is not known; use cu128 (default) or cu130"; exit 2 ;;
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
  { cat "$ROOT/pyproject.toml"; echo "extras=$EXTRAS"; } | sha256sum | cut -d' ' -f1
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
install_staged() {
  local report heavy="" req
  report="$(mktemp)"
  if pip_install --quiet --dry-run --report "$report" -e "$ROOT[$EXTRAS]" 2>/dev/null; then
    heavy="$("$VENV/bin/python" - "$report" <<'PY'
import json
import sys

with open(sys.argv[1]) as f:
    report = json.load(f)
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    big = name.lower().startswith(("nvidia-", "nvfuser")) or name in ("torch", "triton")
    if big and not item["download_info"]["url"].startswith("file:"):
        print(f"{name}=={version}")
PY
)"
  else
    log "pip could not report its plan (pip older than 22.2?); installing in one call"
  fi
  rm -f "$report"
  for req in $heavy; do
    log "installing $req on its own ($(df -h --output=avail "$VENV" | tail -1 | tr -d ' ') free)"
    pip_install --quiet --no-deps "$req"
  done
  pip_install -e "$ROOT[$EXTRAS]"
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
  log "installing sdpa-fusion[$EXTRAS] into $VENV (torch and nvFuser are large: about 8 GB;" \
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
