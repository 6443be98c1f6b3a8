"""Who the browser is: the user's own Kubernetes credential, carried by a session cookie or a header.

- ``Authorization: Bearer`` (or ``token_header``) from an auth proxy in front of the console;
- a token pasted on the sign-in page, kept only in the session cookie: encrypted and authenticated
  (Fernet) with the console's key, HttpOnly, SameSite=Strict, Secure over TLS, and expiring;
- ``local`` mode (`kubectl flow console`): the cookie the launch URL's one-time key sets; the API
  server is `kubectl proxy`, which adds the kubeconfig's credentials.

Nothing is stored server-side. Every form carries a CSRF token bound to the credential
(an HMAC with the console's key), and a POST from another origin is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from functools import cached_property

import orjson
from aiohttp import web
from cryptography.fernet import Fernet, InvalidToken

from flowkube_console.settings import Settings

COOKIE = "flowkube_console"
TOKEN_LIMIT = 16384  # bytes of a bearer token (OIDC tokens with many groups stay well below)
COOKIE_LIMIT = 4000  # bytes of a cookie's value a browser keeps (4096 with its name and attributes)


@dataclass(frozen=True)
class Credential:
    token: str | None  # None: local mode, the proxy adds the credentials
    via: str  # "header" | "session" | "local"

    @cached_property
    def key(self) -> str:
        """Names the credential (feeds, caches, CSRF tokens, stream counts) without holding it twice."""
        return hashlib.sha256((self.token or "local").encode()).hexdigest()


class Auth:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._fernet = Fernet(settings.fernet_key)
        self._launched = False
        # Cookies ignore ports: two local consoles (kubectl flow console twice) keep theirs apart.
        self.cookie = f"{COOKIE}_{settings.port}" if settings.mode == "local" else COOKIE

    def credential(self, request: web.Request) -> Credential | None:
        s = self.settings
        if s.mode != "local":
            for header in ("Authorization", s.token_header):
                value = request.headers.get(header, "") if header else ""
                if header == "Authorization":
                    scheme, _, value = value.partition(" ")
                    value = value if scheme.lower() == "bearer" else ""
                value = value.strip()
                if value and len(value) <= TOKEN_LIMIT:
                    return Credential(value, "header")
        session = self._session(request.cookies.get(self.cookie, ""))
        if session is None:
            return None
        if s.mode == "local":
            return Credential(None, "local") if session.get("local") else None
        token = session.get("token")
        return Credential(str(token), "session") if token else None

    def _session(self, cookie: str) -> dict[str, object] | None:
        if not cookie or len(cookie) > 3 * TOKEN_LIMIT:
            return None
        try:
            raw = self._fernet.decrypt(cookie, ttl=int(self.settings.session_hours * 3600))
            doc = orjson.loads(raw)
        except (InvalidToken, orjson.JSONDecodeError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def _seal(self, token: str | None) -> str:
        doc = {"local": True} if token is None else {"token": token}
        return self._fernet.encrypt(orjson.dumps({**doc, "at": int(time.time())})).decode()

    def fits(self, token: str) -> bool:
        """Whether a session holding ``token`` fits in a cookie (browsers drop a bigger one silently)."""
        return len(self._seal(token)) <= COOKIE_LIMIT

    def sign_in(self, response: web.StreamResponse, request: web.Request, token: str | None) -> None:
        value = self._seal(token)
        response.set_cookie(self.cookie, value, httponly=True, samesite="Strict", secure=is_tls(request), path="/",
                            max_age=int(self.settings.session_hours * 3600))

    def sign_out(self, response: web.StreamResponse) -> None:
        response.del_cookie(self.cookie, path="/")

    def csrf(self, subject: str) -> str:
        """The CSRF token of a credential (``Credential.key``), or of a sign-in page (its nonce)."""
        return hmac.new(self.settings.session_key, f"csrf:{subject}".encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, subject: str, given: str) -> bool:
        return hmac.compare_digest(self.csrf(subject), given or "")

    def launch(self, key: str) -> bool:
        """Local mode: the launch key signs in the first browser that brings it, and no other."""
        ok = not self._launched and bool(self.settings.launch_key) and hmac.compare_digest(
            self.settings.launch_key, key or "")
        self._launched = self._launched or ok
        return ok


def is_tls(request: web.Request) -> bool:
    return request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def same_origin(request: web.Request) -> bool:
    """A POST's Origin (when the browser sends one, as every current one does) is this console."""
    origin = request.headers.get("Origin")
    if origin is None or origin == "null":
        return origin is None
    host = origin.split("://", 1)[-1].rstrip("/")
    return host == request.host
