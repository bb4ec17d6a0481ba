#!/usr/bin/env bash
# Build .venv-openmpi: this Python (torch, transformers, fastdecode... through
# --system-site-packages) with its own mpi4py built against the system's Open MPI, so that the
# multi-rank tests also run under Open MPI's mpirun (.ci/run; docs/site_mpi.md).
#   scripts/openmpi_env.sh        build it, or reuse it when it is already good (seconds)
# Installs openmpi-bin and libopenmpi-dev with apt-get when they are missing (root only).
# Exits 1 saying why when it cannot build one; callers treat the Open MPI tests as optional.
#
# The trap it avoids: pip's MPICH puts its libmpi.so into the Python prefix's lib/, and this
# Python's LDSHARED carries `-L<prefix>/lib` (pyenv and most source builds): that -L comes before
# mpicc's own, so `-lmpi` links MPICH and the import fails with `undefined symbol:
# ompi_mpi_logical8`. MPILD puts Open MPI's library directory first (and in the rpath).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
PY=${PYTHON:-python3}
VENV=$PWD/.venv-openmpi
say() { echo "openmpi_env.sh: $*" >&2; }

# Open MPI's compiler wrapper and launcher: Debian/Ubuntu name them *.openmpi; else MPICC/MPIRUN,
# or a plain mpicc/mpirun on PATH that says it is Open MPI
find_openmpi() {
    MPICC=${MPICC:-}
    MPIRUN=${MPIRUN:-}
    if [[ -z "$MPICC" ]]; then
        if command -v mpicc.openmpi >/dev/null 2>&1; then MPICC=mpicc.openmpi
        elif mpicc --showme:version 2>/dev/null | grep -q "Open MPI"; then MPICC=mpicc; fi
    fi
    if [[ -z "$MPIRUN" ]]; then
        if command -v mpirun.openmpi >/dev/null 2>&1; then MPIRUN=$(command -v mpirun.openmpi)
        elif [[ -n "$MPICC" && -x "$(dirname "$(command -v "$MPICC")")/mpirun" ]] \
            && "$(dirname "$(command -v "$MPICC")")/mpirun" --version 2>/dev/null | grep -q "Open MPI"; then
            MPIRUN=$(dirname "$(command -v "$MPICC")")/mpirun
        fi
    fi
    [[ -n "$MPICC" && -n "$MPIRUN" ]] || return 1
    local inc
    for inc in $("$MPICC" --showme:incdirs 2>/dev/null); do
        [[ -e "$inc/mpi.h" ]] && return 0
    done
    return 1                                         # the wrapper without the headers (no -dev package)
}

if ! find_openmpi; then
    if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        say "no Open MPI with its headers (openmpi-bin, libopenmpi-dev) and not root with apt-get: not built"
        exit 1
    fi
    say "installing openmpi-bin libopenmpi-dev"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            openmpi-bin libopenmpi-dev >/dev/null; }; then
        say "apt-get could not install openmpi-bin libopenmpi-dev: not built"
        exit 1
    fi
    MPICC='' MPIRUN=''
    find_openmpi || { say "Open MPI installed but mpicc.openmpi/mpirun.openmpi or mpi.h not found: not built"; exit 1; }
fi
LIBDIR=$("$MPICC" --showme:libdirs | awk '{print $1}')
ROOT_FLAGS=()
[[ "$(id -u)" -eq 0 ]] && ROOT_FLAGS=(--allow-run-as-root)

EXT_PATH='import mpi4py; mpi4py.rc.initialize = False; import mpi4py.MPI as m; print(m.__file__)'   # no MPI starts
# a 3-rank hello under Open MPI's mpirun (oversubscribed: 2-core machines): every rank sees size 3
hello() {
    timeout 120 "$MPIRUN" "${ROOT_FLAGS[@]}" --oversubscribe -n 3 "$VENV/bin/python" -c \
        'from mpi4py import MPI; c = MPI.COMM_WORLD; print(c.Get_rank(), c.Get_size(), MPI.Get_library_version().split(",")[0])' \
        2>&1 | sort
}
good() {      # sets WHY when not
    local ext out
    WHY="no $VENV"
    [[ -x "$VENV/bin/python" ]] || return 1
    WHY="its mpi4py does not import"
    ext=$("$VENV/bin/python" -c "$EXT_PATH" 2>/dev/null) || return 1
    WHY="it has no mpi4py of its own"
    [[ "$ext" == "$VENV"/* ]] || return 1
    WHY="its mpi4py is linked to MPICH's libmpi.so.12"
    ldd "$ext" | grep -q "libmpi.so.12" && return 1
    out=$(hello) || out=$(hello) || true              # once more: a loaded machine can be slow
    WHY="a 3-rank hello under $MPIRUN failed: $(tail -3 <<<"$out" | xargs)"
    [[ "$(grep -c ' 3 Open MPI' <<<"$out")" -eq 3 ]]
}

# in the venv's bin: `fastdecode` for its Python (the main Python's command would run MPICH's
# mpi4py), and Open MPI's launcher as mpirun/mpiexec, so that with the venv activated the README's
# `mpirun -n 3 fastdecode ...` is Open MPI throughout
commands() {
    printf '#!%s\nimport sys\nfrom fastdecode.cli import main\nsys.exit(main())\n' "$VENV/bin/python" \
        >"$VENV/bin/fastdecode"
    chmod +x "$VENV/bin/fastdecode"
    ln -sf "$MPIRUN" "$VENV/bin/mpirun"
    ln -sf "$MPIRUN" "$VENV/bin/mpiexec"
}

if good; then
    commands
    say "reusing $VENV (mpi4py on Open MPI: $(hello | head -1 | cut -d' ' -f3-))"
    exit 0
fi
[[ -x "$VENV/bin/python" ]] && say "not reusing $VENV: $WHY"
say "building $VENV: mpi4py against Open MPI ($MPICC, $LIBDIR); a few minutes"
"$PY" -m venv --clear --system-site-packages "$VENV"
# the main Python's mpi4py version when it has one (the same API in both environments)
VERSION=$("$PY" -c 'import mpi4py; print("==" + mpi4py.__version__)' 2>/dev/null || true)
if ! MPICC=$MPICC MPILD="$MPICC -L$LIBDIR -Wl,-rpath,$LIBDIR" "$VENV/bin/python" -m pip install \
        --disable-pip-version-check -q --no-binary=mpi4py --no-cache-dir --ignore-installed --no-deps \
        "mpi4py$VERSION" >"$VENV/build.log" 2>&1; then
    tail -20 "$VENV/build.log" >&2
    say "building mpi4py against Open MPI failed (log: $VENV/build.log)"
    exit 1
fi
EXT=$("$VENV/bin/python" -c "$EXT_PATH" 2>&1) \
    || { say "the new mpi4py does not import: $EXT"; exit 1; }
say "$(ldd "$EXT" | grep -E 'libmpi\.so' | xargs)"
if ! good; then
    say "the new mpi4py fails: $WHY"
    exit 1
fi
commands
say "ready: $VENV/bin/python, mpi4py on $("$VENV/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().split(",")[0])'), launcher $MPIRUN"
