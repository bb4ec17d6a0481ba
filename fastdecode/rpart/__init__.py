"""The R-part seen from the S-worker: the backend interface (base), in-process (local), over MPI
(mpi, with staging for device<->host copies), and a loopback for timing the S-worker alone.
"""
