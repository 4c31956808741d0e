#!/bin/bash
# launch_rate --devices cuda:0 in turn on one host: the working tree's Python files ('new') against those of an
# earlier commit ('old'), with the same compiled core (hosts differ by a third in their direct launch time, so only
# runs taken in turn on one host compare).
#   here:        bash bench/fidelity/launch_rate_ab.sh prepare REV [FILE...]   (default: the files REV..HEAD changed)
#   on the H200: bash bench/fidelity/launch_rate_ab.sh run [ROUNDS]            (carry .helper, .whl, mpsd/_core.abi3.so, protocol/mpsd_protocol/_wire.abi3.so)
set -u
case ${1:-} in
prepare)
    rev=$2; shift 2
    files=("$@"); [ ${#files[@]} -gt 0 ] || mapfile -t files < <(git diff --name-only --diff-filter=M "$rev" HEAD -- 'mpsd*/*.py')
    rm -rf .helper/ab && mkdir -p .helper/ab/old .helper/ab/new
    for f in "${files[@]}"; do
        mkdir -p ".helper/ab/old/$(dirname "$f")" ".helper/ab/new/$(dirname "$f")"
        git show "$rev:$f" > ".helper/ab/old/$f" && cp "$f" ".helper/ab/new/$f"
    done
    echo "prepared ${#files[@]} files of $rev in .helper/ab/old";;
run)
    source bench/fidelity/device_env.sh || exit 1
    for ((round = 0; round < ${2:-2}; round++)); do
        for side in new old; do
            cp -r ".helper/ab/$side/." .
            echo "== $side"
            python3 bench/launch_rate.py --devices cuda:0 --repeat 3 2>&1 | grep -E "mpsd rate|daemon CPU|raw rate|ratio"
        done
    done
    cp -r .helper/ab/new/. .;;
*)
    echo "usage: $0 prepare REV [FILE...] | run [ROUNDS]" >&2; exit 2;;
esac
