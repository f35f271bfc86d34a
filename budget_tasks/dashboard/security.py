"""Who may write from the dashboard: the operator token, and forms that only this page
can have made (same origin, a CSRF token bound to the form's action and target)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

#: How long a form's CSRF token is accepted (seconds).
CSRF_TTL = 3600


class Guard:
    """The token check and the CSRF tokens of one dashboard process.

    ``token`` None: the dashboard is read-only and refuses every write."""

    def __init__(self, token: str | None, secret: bytes | None = None) -> None:
        self.token = token or None
        # per process: a restart invalidates the forms it served, nothing else
        self._secret = secret or secrets.token_bytes(32)

    @property
    def writable(self) -> bool:
        return self.token is not None

    def token_ok(self, given: str | None) -> bool:
        """The operator's token, compared in constant time."""
        if self.token is None or not given:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _mac(self, action: str, target: str, issued: int) -> str:
        message = f"{action}\n{target}\n{issued}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def csrf_for(self, action: str, target: str, now: float | None = None) -> str:
        """A token for one form: this action on this target, for :data:`CSRF_TTL`."""
        issued = int(time.time() if now is None else now)
        return f"{issued}.{self._mac(action, target, issued)}"

    def csrf_ok(self, given: str | None, action: str, target: str) -> bool:
        if not given or "." not in given:
            return False
        issued_text, mac = given.split(".", 1)
        if not issued_text.isdigit():
            return False
        issued = int(issued_text)
        if not 0 <= time.time() - issued <= CSRF_TTL:
            return False
        return hmac.compare_digest(mac, self._mac(action, target, issued))


def same_origin(headers: Mapping[str, str], scheme: str) -> bool:
    """Whether a request came from this site: a browser's ``Sec-Fetch-Site`` says so
    itself; else an ``Origin`` must name this host. A request with neither (a script,
    curl) is no browser's cross-site request and passes this check."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = headers.get("origin")
    if origin is None:
        return True
    return origin == f"{scheme}://{headers.get('host', '')}"
