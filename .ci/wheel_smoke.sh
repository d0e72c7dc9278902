#!/usr/bin/env bash
# The wheel, installed alone. The test suite runs against an editable install of the tree, so
# a module or data file left out of the wheel, or a dependency that only the dev extra brings,
# would pass it and break every user. Here python -m build makes the sdist and the wheel (from
# the sdist), and the wheel, not the tree, goes into fresh virtual environments outside the
# repository, where .ci/wheel_checks.py runs what a user runs first: with no extra, then with
# each of train, hf and lightning alone, since an extra installed beside another could lean on
# its packages unseen.
#
# Needs the repository's .venv (make setup: its pip and build are used). Each environment gets
# the pinned torch from pip's local file or cache; a few minutes in all.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="$REPO/.venv/bin/python"
# A venv is some 25,000 files: on a busy disk writing and removing them costs a minute each,
# on tmpfs seconds. /dev/shm where it has room (one venv lives at a time) and runs programs.
scratch="${TMPDIR:-/tmp}"
if [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt $((4 << 20)) ] \
    && ! findmnt -no OPTIONS --target /dev/shm | grep -qw noexec; then
    scratch=/dev/shm
fi
WORK="$(mktemp -d "$scratch/distopt-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"  # nothing of the repository on sys.path or in the working directory
export OMP_NUM_THREADS=1
# Installs compile no bytecode (all of torch would cost more than it saves); let the imports
# cache what they use, or every process of every check compiles it again.
unset PYTHONDONTWRITEBYTECODE

new_venv() {  # new_venv NAME: an empty environment; the repository's pip installs into it
    python3 -m venv --without-pip "$WORK/$1"
}
add() {  # add NAME SPEC: install SPEC with the pinned versions (torch==2.13.0 above all)
    "$PY" -m pip --python "$WORK/$1/bin/python" install -q --no-compile \
        -c "$REPO/constraints.txt" "$2"
}
check() {  # check NAME EXTRA
    "$WORK/$1/bin/python" "$REPO/.ci/wheel_checks.py" "$2" "$WORK/out-$2"
    echo "   ($((SECONDS - start)) s)"
}

start=$SECONDS
# Built from a copy of the files git tracks or would track: in the tree itself setuptools
# would also ship what a stale build/ or src/*.egg-info lists, hiding a package the
# configuration leaves out.
mkdir "$WORK/tree"
git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | tar -C "$REPO" --null -T - --ignore-failed-read -cf - | tar -C "$WORK/tree" -xf -
"$PY" -m build --outdir "$WORK/dist" "$WORK/tree" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
rm -rf "${WORK:?}/tree"
WHEEL="$(echo "$WORK"/dist/*.whl)"
echo "built $(basename "$WORK"/dist/*.tar.gz) and $(basename "$WHEEL") ($((SECONDS - start)) s)"

start=$SECONDS
echo "== $(basename "$WHEEL"), no extra, in a fresh venv"
new_venv base
add base "$WHEEL"
check base none
# The same environment with the train extra added holds what a fresh install of
# wheel[train] would, for one torch install fewer.
start=$SECONDS
echo "== the train extra added to it"
add base "$WHEEL[train]"
check base train
rm -rf "${WORK:?}/base"  # about 1 GB each
for extra in hf lightning; do
    start=$SECONDS
    echo "== $(basename "$WHEEL")[$extra] in a fresh venv"
    new_venv "$extra"
    add "$extra" "$WHEEL[$extra]"
    check "$extra" "$extra"
    rm -rf "${WORK:?}/$extra"
done
# The README's third install line: pip builds distopt from a git URL itself (here the
# repository's own HEAD, as a remote's URL would give a commit of it).
start=$SECONDS
echo "== from a git URL, in a fresh venv"
new_venv git
add git "torch-distopt @ git+file://$REPO"
check git none
rm -rf "${WORK:?}/git"
