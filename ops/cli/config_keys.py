"""`tape config keys`: every key a cluster config may hold (runtime/settings.py KEYS), with its
default and meaning, as the Markdown table docs/runbook.md shows (a test holds them equal)."""

from __future__ import annotations

from tape.runtime.settings import KEYS, ClientSettings, Config, NodeSettings, default_of

SCHEMA_OF = {"node": NodeSettings, "client": ClientSettings}  # every other section fills Config
FIELD_OF = {"replay": "replay_{}"}  # a section whose keys fill Config's fields of another name


def _default(section: str, key: str) -> str:
    if section == "keys" or "(required)" in KEYS[section][key]:
        return "—"
    value = default_of(SCHEMA_OF.get(section, Config), FIELD_OF.get(section, "{}").format(key))
    return "—" if value in ("", [], None) else f"`{value!r}`".replace("'", '"')


def key_reference() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for section, keys in KEYS.items():
        prefix = {"": "", "node": "[[node]] ", "client": "[[client]] "}.get(section, f"[{section}] ")
        rows += [f"| {prefix}`{key}` | {_default(section, key)} | {meaning} |" for key, meaning in keys.items()]
    return "\n".join(rows) + "\n"
