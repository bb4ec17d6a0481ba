"""Host and MPI plumbing both sides use: waiting without starving other ranks (wait), moving
messages while computing (progressor), cores and threads (cores, threads), KV memory (capacity),
and test fault injection (faults). numpy and mpi4py only.
"""
