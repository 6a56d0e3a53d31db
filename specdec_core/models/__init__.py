"""Models around the algorithm: pairs, loading (the bundled pair, hub ids, local directories),
CPU quantisation and a tiny random pair for tests. Its names are imported when first used, as the package's are."""
from .. import lazily

HOMES = {"LoadOptions": "load", "load_pair": "load", "load_hub_pair": "load", "enable_graphs": "load",
         "Pair": "pair", "make_pair": "pair", "pick_device": "pair", "pick_dtype": "pair", "first_divergence": "pair",
         "dtype_name": "pair"}
__all__ = list(HOMES)
__getattr__ = lazily(__name__, HOMES)
