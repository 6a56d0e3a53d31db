"""What a visitor asks for, built in one place from the controls (or the API's arguments) by name."""
from __future__ import annotations

from dataclasses import dataclass, fields

from specdec_core import SpecConfig
from specdec_core.drafters import DRAFTERS

from .i18n import Said

INSPECTOR_TOP = 5  # top-n probabilities the inspector shows per position


@dataclass(frozen=True)
class Ask:
    cfg: SpecConfig
    drafter: str = DRAFTERS[0]
    lang: str = "en"  # a code or a LANGUAGES label (i18n.t takes both)


def ask(values: dict) -> Ask:
    """{name: value}: SpecConfig's fields (a missing or None one takes its default), "drafter" and "lang".
    Raises ValueError with a readable message."""
    for name in ("k", "max_new_tokens", "top_k", "seed"):
        value = values.get(name, 0)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise Said("setting_missing", name=name)
    names = {f.name for f in fields(SpecConfig)}
    given = {name: value for name, value in values.items() if name in names and value is not None}
    cfg = SpecConfig(**{"record_top": INSPECTOR_TOP, **given})
    return Ask(cfg, values.get("drafter") or DRAFTERS[0], values.get("lang") or "en")
