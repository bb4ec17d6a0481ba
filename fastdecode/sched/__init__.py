"""Scheduling: which sequences run (scheduler), when new ones are admitted (admission, with the
load-stabilizing controller and its learnt length model), and which R-worker holds each one's
KV-cache (placement). simulate drives the controllers over a request trace without a model.
"""
