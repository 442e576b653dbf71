# Shared by .ci/run, .ci/verl and .ci/veomni (sourced, not run).

run_pytest() {  # pytest with the active venv's python; no tests collected (exit 5) is a failure
    local rc=0
    python -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "no tests collected: failing" >&2; rc=1; fi
    return "$rc"
}

venv_script_main() {  # the command line of a script that defines prepare VENV and run_tests VENV:
    # `prepare VENV`, `test VENV`, or nothing (a venv in a temporary folder: prepare, run_all if the
    # script defines it, else run_tests, remove). A script with verbs of its own handles them first.
    case "${1:-}" in
        prepare) prepare "${2:?usage: $0 prepare VENV}" ;;
        test) run_tests "${2:?usage: $0 test VENV}" ;;
        "")
            local dir
            dir=$(mktemp -d)
            trap "rm -rf '$dir'" EXIT
            prepare "$dir/venv"
            if declare -F run_all > /dev/null; then run_all "$dir/venv"; else run_tests "$dir/venv"; fi ;;
        *) echo "usage: $0 [prepare VENV | test VENV${EXTRA_USAGE:-}], got '$1'" >&2; return 2 ;;
    esac
}

# Installs. `.ci/run` sets up uv (`ci_uv_setup`) and every venv's installs go through it: the same
# releases as pip picks (pip's find-links and constraint passed on, from its env or its files;
# compared package by package on 2026-12-07), each wheel unpacked once into uv's cache and linked into each venv, and compiled to
# bytecode as pip does (these machines set PYTHONDONTWRITEBYTECODE, so without it every process
# compiles torch and transformers again: their import took 11.6 s against 4.7). On the CI's 2
# cores the main venv took 31 s against pip's 90 s, and six venvs are made. Without CI_UV (a
# script run on its own, or uv not installable), pip.
ci_uv_setup() {  # $1: a new folder: uv's own venv, and its cache beside it. Exports CI_UV, or warns and leaves pip
    local links constraint
    if ! { python3 -m venv "$1/venv" && "$1/venv/bin/python" -m pip install -q uv; }; then
        echo "uv could not be installed: pip installs every venv" >&2
        return 0
    fi
    export CI_UV="$1/venv/bin/uv" UV_CACHE_DIR="$1/cache" UV_COMPILE_BYTECODE=1
    links=${PIP_FIND_LINKS:-$(pip_file_setting find-links)}
    constraint=${PIP_CONSTRAINT:-$(pip_file_setting constraint)}
    if [ -n "$links" ]; then export UV_FIND_LINKS="${links//[[:space:]]/,}"; fi  # pip: whitespace; uv: commas
    if [ -n "$constraint" ]; then export UV_CONSTRAINT="$constraint"; fi
}

pip_file_setting() {  # $1: a pip option: its value in pip's configuration files (the last file's), or nothing
    # (`pip config get` reads one file only; `pip config list` prints every file's, and the env's as `:env:.`)
    python3 -m pip config list 2>/dev/null | sed -n "/^:env:/d; s/^[^.]*\.$1='\(.*\)'\$/\1/p" | tail -n 1
}

ci_venv() {  # $1: a new venv's folder: made and activated (and its pip upgraded, where pip installs)
    python3 -m venv "$1" || return 1
    . "$1/bin/activate"
    if [ -z "${CI_UV:-}" ]; then python -m pip install -q --upgrade pip || return 1; fi
}

ci_install() {  # `pip install`'s arguments, into the active venv (uv has no --no-warn-conflicts: dropped)
    if [ -n "${CI_UV:-}" ]; then
        local args=() arg
        for arg in "$@"; do
            if [ "$arg" != "--no-warn-conflicts" ]; then args+=("$arg"); fi
        done
        "$CI_UV" pip install --python "$(command -v python)" "${args[@]}"
    else
        python -m pip install "$@"
    fi
}
