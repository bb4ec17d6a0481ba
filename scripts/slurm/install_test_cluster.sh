#!/usr/bin/env bash
# Installs what tests/test_slurm.py needs for its test SLURM cluster on this one machine:
# Debian's slurm-wlm 22.05 daemons (slurmctld, slurmd), the client commands, munge, numactl,
# the PMIx library for `srun --mpi=pmix`, and Debian's Open MPI + mpi4py as a "site MPI".
# Idempotent: does nothing when everything is already there. Needs root and apt-get.
# It only installs packages; it starts nothing (tests/slurm/cluster.py starts the daemons
# from a private config under a temp dir and never touches /etc/slurm).
set -euo pipefail

need=()
for cmd in slurmctld slurmd sbatch munged numactl; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
compgen -G "/usr/lib/*/pmix2/lib/libpmix.so" >/dev/null || need+=(libpmix.so)
/usr/bin/python3 -c "import mpi4py" 2>/dev/null || need+=(python3-mpi4py)
if [ ${#need[@]} -eq 0 ]; then
    echo "install_test_cluster: slurm, munge, numactl, pmix, python3-mpi4py already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_test_cluster: missing ${need[*]} and not root: cannot apt-get install" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_cluster: missing ${need[*]} and no apt-get on this system" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# The package scripts try to start the daemons with the system's config; in containers
# policy-rc.d already forbids that, and where it does not the daemons fail harmlessly on
# the missing /etc/slurm/slurm.conf. Either way our test cluster starts its own copies.
apt-get update -qq
# libpmix-dev: Debian's mpi/pmix plugin dlopen()s the unversioned pmix2/lib/libpmix.so,
# which only the -dev package ships; without it `srun --mpi=pmix` is unavailable.
# python3-mpi4py: Debian's mpi4py on Debian's Open MPI (built with PMIx and UCX) stands in
# for a site MPI in the `srun --mpi=pmix` test; the pip MPICH has no PMIx support.
apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge numactl libpmix-dev python3-mpi4py >/dev/null
echo "install_test_cluster: installed $(slurmd -V)"
