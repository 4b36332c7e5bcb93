"""``GET`` / ``DELETE /v1/sessions/{id}``: what the fleet keeps for a session, and forgetting it.

A session id follows the one rule chat requests follow (``sampling.session_id_of``): an id that rule
refuses is a 400 here too, and an id with ``/`` (which the rule allows, like model names) is routed
whole (``/v1/sessions/team/s2``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from metrale.gateway.api.prepare.sampling import checked_session_id
from metrale.gateway.state import gateway_of
from metrale.shared.errors import SessionNotFound

router = APIRouter()


def _session_id(raw: str) -> str:
    return checked_session_id(raw, param="session_id")


@router.get("/v1/sessions/{session_id:path}")
async def get_session(session_id: str, request: Request) -> dict[str, object]:
    """What the fleet keeps for a session: tokens its newest checkpoint covers, bytes, last use, tier, and
    how many turns could not resume from it (``retokenized``: it was not a prefix of their prompt)."""
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    session_id = _session_id(session_id)
    entry = await gateway.sessions.entry(tenant, session_id)
    transcript = await gateway.sessions.transcript(tenant, session_id)
    if entry is None and transcript is None:
        raise SessionNotFound(f"No session {session_id!r}.", param="session_id")
    return {
        "id": session_id,
        "object": "session",
        "tokens": entry.length if entry is not None else 0,
        "transcript_tokens": len(transcript.token_ids) if transcript is not None else 0,
        "bytes": entry.nbytes if entry is not None else 0,
        "last_use": entry.last_use if entry is not None else None,
        "tier": entry.tier if entry is not None else None,
        "retokenized": await gateway.sessions.retokenized(tenant, session_id),
    }


@router.delete("/v1/sessions/{session_id:path}")
async def delete_session(session_id: str, request: Request) -> dict[str, object]:
    """Forget a session and its checkpoint."""
    gateway = gateway_of(request)
    tenant = gateway.auth.tenant_for(request.headers.get("authorization"))
    session_id = _session_id(session_id)
    if not await gateway.sessions.delete(tenant, session_id):
        raise SessionNotFound(f"No session {session_id!r}.", param="session_id")
    return {"id": session_id, "object": "session.deleted", "deleted": True}
