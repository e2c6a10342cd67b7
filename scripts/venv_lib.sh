# Sourced by the bootstrap scripts: one venv, created on first use and re-installed only when
# pyproject.toml, the calling script or this file changed (a hash of the three is stamped into the venv).
#   venv_up_to_date VENV SCRIPT   -> exit status 0 when nothing changed
#   venv_create VENV              -> the venv with a current pip
#   venv_pip VENV ARGS...         -> pip install ARGS into VENV
#   venv_stamp VENV SCRIPT        -> record the installed state
# pip byte-compiles what it installs (~60% of a venv's setup time here: 97 s with, 40 s without, for
# .venv). Keep it: these machines set PYTHONDONTWRITEBYTECODE=1, so without pip's .pyc files every
# process (each Ray worker, torchrun rank, driver) would compile torch and transformers again.
_venv_hash() { cat pyproject.toml "$1" scripts/venv_lib.sh | sha256sum | cut -c1-16; }
venv_up_to_date() { [ -f "$1/.hybridflow-installed" ] && [ "$(cat "$1/.hybridflow-installed")" = "$(_venv_hash "$2")" ]; }
venv_create() {
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  venv_pip "$1" --upgrade pip
}
venv_pip() { "$1/bin/pip" install -q "${@:2}"; }
venv_stamp() { _venv_hash "$2" > "$1/.hybridflow-installed"; }
