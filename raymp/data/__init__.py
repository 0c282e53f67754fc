from raymp.data.corpus import DataError
from raymp.data.order import DataPosition, GlobalOrder, TrainOrder, replica_slice
from raymp.data.packed import PackedDataset, load_dataset, open_packed

__all__ = ["DataError", "DataPosition", "GlobalOrder", "TrainOrder", "replica_slice", "PackedDataset",
           "load_dataset", "open_packed"]
