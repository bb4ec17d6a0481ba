"""The R-worker: KV-cache in host memory and decode attention over it. Never imports torch."""
from .isa import available_isas, cpu_features, selected_isa
from .kvstore import KVCapacityError, KVStore

__all__ = ["KVCapacityError", "KVStore", "available_isas", "cpu_features", "selected_isa"]
