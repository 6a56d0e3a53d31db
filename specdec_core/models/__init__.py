"""Models around the algorithm: pairs, loading (the bundled pair, hub ids, local directories),
CPU quantisation and a tiny random pair for tests."""
from .load import TARGET_QUANTS, LoadOptions, enable_graphs, load_hub_pair, load_pair
from .pair import Pair, dtype_name, first_divergence, make_pair, pick_device, pick_dtype

__all__ = ["Pair", "TARGET_QUANTS", "LoadOptions", "load_pair", "load_hub_pair", "make_pair", "enable_graphs", "pick_device", "pick_dtype",
           "first_divergence", "dtype_name"]
