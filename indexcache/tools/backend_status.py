"""What ``indexcache info`` prints: which backend is selected and why, and every backend's availability, as data."""

from __future__ import annotations

from typing import Any

from indexcache.hal import dispatch


def backend_status() -> dict[str, Any]:
    """``{"selected", "why", "backends": [{name, available, reason, mode, device, auto, priority, ops, info}]}``.

    An unknown name in ``INDEXCACHE_BACKEND`` raises :class:`~indexcache.hal.dispatch.UnknownBackendError`.
    """
    chosen = dispatch.explicit_choice()
    if chosen:
        selected, why = chosen[0], f"chosen by {chosen[1]}"
    else:
        selected, why = dispatch.default_backend()
        why = f"automatic: {why}"
    backends = []
    for name, backend in sorted(dispatch.registry().items(), key=lambda kv: -kv[1].priority):
        avail = dispatch.availability(name)
        backends.append({
            "name": name,
            "available": avail.available,
            "reason": avail.reason,
            "mode": avail.mode,
            "device": avail.device,
            "auto": avail.auto,
            "priority": backend.priority,
            "ops": sorted(dispatch.ops_of(name)),
            "info": backend.info() if avail.available else {},
        })
    return {"selected": selected, "why": why, "backends": backends}
