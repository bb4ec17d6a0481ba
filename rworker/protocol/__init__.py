"""The S-worker <-> R-worker protocol, written once and imported by both sides (numpy only):
control messages, tags and version (control), the data messages' layout (wire), and the KV
formats both sides count in (kvformat).
"""
