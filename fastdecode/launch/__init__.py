"""Launch: MPI roles and rank-0 failure handling (mpi_env), the supervisor that names a dying
rank (supervise), and `fastdecode info` (info).
"""
