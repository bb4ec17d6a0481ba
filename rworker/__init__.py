from .kvstore import KVStore
from .isa import selected_isa, available_isas, cpu_features
