"""The sizing model: how many CPU sockets (R-workers) a GPU needs, and how a batch splits between
them and the S-worker's own KV tier. schema is the profile's format, profile and measure take one
on the job's machines, hardware builds one from stated hardware, model predicts from it (split:
the tier's share, by placement's rule; balance: what of a batch the engine's balance rule runs, and
the best tokens/s per socket count), and plan is the `fastdecode plan` command.
"""
