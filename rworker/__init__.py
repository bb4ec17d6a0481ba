"""The R-worker: KV-cache in host memory and decode attention over it. Never imports torch."""
from rworker.isa import available_isas, cpu_features, selected_isa
from rworker.kvstore import KVCapacityError, KVStore

__all__ = ["KVCapacityError", "KVStore", "available_isas", "cpu_features", "selected_isa"]
