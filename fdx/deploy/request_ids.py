"""Request ids across the API and the engines: a user aborts by the id the
API returned (``cmpl-...`` / ``chatcmpl-...``), while a request with
``n > 1`` (or several prompts) runs as engine requests ``<id>-<choice
index>``.  Read from a front end's live handles (``client._live``: engine
id -> handle with its ``tag`` and ``sink``), so every deployment's front
end maps ids the same way; used by the control routes' ``abort_requests``."""

from __future__ import annotations

import collections
from typing import Any


def _live(client: Any) -> dict[str, Any]:
    return dict(getattr(client, "_live", {}) or {})


def engine_ids_for(client: Any, rid: str) -> list[str]:
    """Engine ids of the live request the API returned as ``rid``: ``rid``
    itself, or ``rid-<k>`` for its choice ``k`` (n > 1 / several prompts).
    Falls back to ``[rid]`` so an id only the engine knows is still tried."""
    out = []
    for eid, h in _live(client).items():
        if eid == rid:
            out.append(eid)
            continue
        idx = getattr(getattr(h, "tag", None), "index", None)
        if isinstance(idx, int) and eid == f"{rid}-{idx}":
            out.append(eid)
    return out or [rid]


def api_ids(client: Any) -> dict[str, str]:
    """engine id -> id the API returned, for every live request.  A choice
    ``rid-<k>`` maps to ``rid`` when its siblings are still live or k > 0
    (an n > 1 request whose other choices all ended keeps ``rid-0``).
    Siblings are the handles sharing one sink queue (one HTTP request)."""
    live = _live(client)
    per_sink = collections.Counter(id(getattr(h, "sink", h)) for h in live.values())
    out = {}
    for eid, h in live.items():
        idx = getattr(getattr(h, "tag", None), "index", None)
        suffix = f"-{idx}"
        grouped = isinstance(idx, int) and (idx > 0 or per_sink[id(getattr(h, "sink", h))] > 1)
        out[eid] = eid[: -len(suffix)] if grouped and eid.endswith(suffix) else eid
    return out


def group_aborted(aborted: list[dict[str, Any]], owner: dict[str, str]) -> list[dict[str, Any]]:
    """Merge engine-level abort entries into one entry per API id."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in aborted:
        eid = str(a.get("request_id"))
        groups.setdefault(owner.get(eid, eid), []).append(a)
    out = []
    for rid, items in groups.items():
        entry: dict[str, Any] = {
            "request_id": rid,
            "output_token_count": sum(int(i.get("output_token_count", 0)) for i in items),
        }
        if len(items) > 1 or items[0].get("request_id") != rid:
            entry["choices"] = items
        out.append(entry)
    return out
