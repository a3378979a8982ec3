# Sourced by the device scripts (wheels.sh, rehearse.sh): the GPU machine's Python version found here.

# device_python: a Python of the GPU machine's version ([python] in stack.txt), or one clear error
device_python() {
  local want c
  want=$(python3 "$(dirname "${BASH_SOURCE[0]}")/stack.py" python)
  for c in "${DEVICE_PY:-}" "python$want" /root/.pyenv/versions/"$want".*/bin/python"$want" /usr/bin/python"$want"; do
    [ -n "$c" ] || continue
    if "$c" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "error: no Python $want here (the GPU machine's); install it (apt-get install python$want-venv, or pyenv) or set DEVICE_PY" >&2
  return 1
}

# pip's warnings about this machine's configured local indexes that do not exist say nothing about the work
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }
