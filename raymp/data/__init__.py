from raymp.data.corpus import DataError
from raymp.data.order import GlobalOrder, replica_slice
from raymp.data.packed import PackedData, load_packed

__all__ = ["DataError", "GlobalOrder", "replica_slice", "PackedData", "load_packed"]
