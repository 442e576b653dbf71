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
