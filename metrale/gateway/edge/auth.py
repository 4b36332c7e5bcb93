"""API keys: ``Authorization: Bearer <key>`` names the tenant a request runs for.

With no keys configured (``MET_API_KEYS`` unset) the gateway is open and every request belongs to
``DEFAULT_TENANT``; ``create_app`` logs a warning saying so.

A request carrying the header more than once names no one tenant: it is a malformed request (HTTP
allows repeating only list-valued headers, and ``Authorization`` is not one), refused with a 400
rather than served as whichever key came first. Not a 401: no key is wrong, and a client that
retries with one of them (as it would after a 401) may land on a different tenant than it meant.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from metrale.shared.errors import BadRequest, Unauthorized
from metrale.shared.settings import DEFAULT_TENANT


def authorization_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The one ``Authorization`` header among an ASGI scope's ``headers`` (None without one); raises
    ``BadRequest`` when there are several."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) > 1:
        raise BadRequest(
            f"The request carries {len(values)} Authorization headers: send exactly one "
            "('Authorization: Bearer <key>').",
            param="Authorization",
        )
    return values[0].decode("latin-1") if values else None


class ApiKeyAuth:
    """Maps an ``Authorization`` header to a tenant; keys are compared in constant time."""

    def __init__(self, api_keys: Mapping[str, str]) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in api_keys.items()]

    @property
    def required(self) -> bool:
        """Whether requests must present a key."""
        return bool(self._keys)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of the key in ``authorization``; raises ``Unauthorized`` for a missing or unknown key."""
        if not self._keys:
            return DEFAULT_TENANT
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        candidate = presented.strip().encode()
        tenant = None
        for key, key_tenant in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(key, candidate):
                tenant = key_tenant
        if tenant is None:
            raise Unauthorized("Invalid API key.")
        return tenant
