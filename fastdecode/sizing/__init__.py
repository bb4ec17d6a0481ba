"""The sizing model: how many CPU sockets (R-workers) a GPU needs. schema is the profile's
format, profile and measure take one on the job's machines, hardware builds one from stated
hardware, model predicts from it, and plan is the `fastdecode plan` command.
"""
