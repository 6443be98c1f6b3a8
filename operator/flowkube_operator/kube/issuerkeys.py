"""A runner's token checked here first: signature, expiry and audience, with the cluster's own keys.

The state API used to send every token that *looked* right (its unverified claims) to a TokenReview;
a pod could make up such tokens by the thousand, and each one waited for a review slot. A projected
ServiceAccount token is a JWT signed by the API server's service-account issuer, whose public keys
the API server publishes (OIDC discovery: `/.well-known/openid-configuration` names the `jwks_uri`,
normally `/openid/v1/jwks`; the default `system:service-account-issuer-discovery` binding lets every
ServiceAccount read both, and the chart's ClusterRole grants them too). With those keys a forged,
expired or wrongly addressed token is refused on the spot, before anything waits.

The keys are read at the first token, again every REFRESH_SECONDS, and at once when a token names a
key id (`kid`) not in the set (the issuer rotated its key), at most once per REFETCH_SECONDS so that
made-up key ids cannot make the operator fetch the set again and again. When the keys cannot be read
(RBAC, an API server that does not serve them) verification is skipped (the caller falls back to the
TokenReview alone, as before) and the reason is logged once.

The pure part (parsing, JWK to key, signature and claims) has no I/O; `IssuerKeys` reads the keys.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from flowkube_operator.kube.client import ApiError, Kube

log = logging.getLogger("flowkube.issuerkeys")

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/openid/v1/jwks"  # Kubernetes' own, when discovery names none or names another host
REFRESH_SECONDS = 600.0  # keys are read again this often (rotation is also caught by an unknown kid)
REFETCH_SECONDS = 10.0  # at most one read per this, whatever key ids tokens name; also the retry period
LEEWAY_SECONDS = 60  # clock skew allowed on exp and nbf
KEYS_LIMIT = 64  # keys kept from one set (a real issuer has one to a few)

PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {
    "RS256": hashes.SHA256, "RS384": hashes.SHA384, "RS512": hashes.SHA512,
    "ES256": hashes.SHA256, "ES384": hashes.SHA384, "ES512": hashes.SHA512,
}
_CURVES: dict[str, ec.EllipticCurve] = {"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}


class TokenRefused(Exception):
    """The token is not one the cluster's issuer signed for us, now; the message says why."""


@dataclass(frozen=True)
class Jwt:
    header: dict[str, Any]
    claims: dict[str, Any]
    signed: bytes  # header.payload, as signed
    signature: bytes


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _int(part: object) -> int:
    if not isinstance(part, str):
        raise ValueError("not a base64url string")
    return int.from_bytes(_b64(part), "big")


def parse(token: str) -> Jwt:
    """A compact JWS, decoded but not verified."""
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenRefused("not a JWT")
    try:
        header, claims = json.loads(_b64(parts[0])), json.loads(_b64(parts[1]))
        signature = _b64(parts[2])
    except ValueError as e:
        raise TokenRefused("not a JWT") from e
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise TokenRefused("not a JWT")
    return Jwt(header=header, claims=claims, signed=f"{parts[0]}.{parts[1]}".encode("ascii"), signature=signature)


def public_key(jwk: Mapping[str, Any]) -> PublicKey | None:
    """An RSA or EC signing key of a JWK set; None for anything else (an encryption key, an unknown curve)."""
    if jwk.get("use") not in (None, "sig"):
        return None
    try:
        if jwk.get("kty") == "RSA":
            return rsa.RSAPublicNumbers(_int(jwk.get("e")), _int(jwk.get("n"))).public_key()
        curve = _CURVES.get(str(jwk.get("crv")))
        if jwk.get("kty") == "EC" and curve is not None:
            return ec.EllipticCurvePublicNumbers(_int(jwk.get("x")), _int(jwk.get("y")), curve).public_key()
    except ValueError:
        return None
    return None


def keys_of(jwks: object) -> dict[str, PublicKey]:
    """kid -> key of a JWK set (a key without a kid under ""); at most KEYS_LIMIT."""
    found: dict[str, PublicKey] = {}
    entries = jwks.get("keys") if isinstance(jwks, Mapping) else None
    for jwk in entries if isinstance(entries, list) else []:
        key = public_key(jwk) if isinstance(jwk, Mapping) else None
        if key is not None and len(found) < KEYS_LIMIT:
            found[str(jwk.get("kid") or "")] = key
    return found


def signature_valid(jwt: Jwt, key: PublicKey) -> bool:
    alg = str(jwt.header.get("alg"))
    digest = _HASHES.get(alg)
    if digest is None:
        return False
    try:
        if alg.startswith("RS") and isinstance(key, rsa.RSAPublicKey):
            key.verify(jwt.signature, jwt.signed, padding.PKCS1v15(), digest())
            return True
        if alg.startswith("ES") and isinstance(key, ec.EllipticCurvePublicKey):
            half = (key.curve.key_size + 7) // 8
            if len(jwt.signature) != 2 * half:
                return False
            r, s = int.from_bytes(jwt.signature[:half], "big"), int.from_bytes(jwt.signature[half:], "big")
            key.verify(encode_dss_signature(r, s), jwt.signed, ec.ECDSA(digest()))
            return True
    except InvalidSignature:
        return False
    return False


def claims_problem(claims: Mapping[str, Any], audience: str, now: float) -> str | None:
    """Why the claims are not those of a token for `audience` that is valid now, or None. Kubernetes
    puts exp on every projected token; one without it is refused."""
    aud = claims.get("aud")
    if audience not in (aud if isinstance(aud, list) else [aud]):
        return f"not a token for audience {audience}"
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if not isinstance(exp, int | float) or isinstance(exp, bool) or exp + LEEWAY_SECONDS < now:
        return "the token has expired"
    if isinstance(nbf, int | float) and not isinstance(nbf, bool) and nbf - LEEWAY_SECONDS > now:
        return "the token is not valid yet"
    return None


class IssuerKeys:
    """The service-account issuer's keys, read from the API server, and `verify` with them."""

    def __init__(self, kube: Callable[[], Kube | None], *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._kube = kube
        self._clock = clock
        self._wall = wall
        self._keys: dict[str, PublicKey] | None = None  # None: not read (yet, or it failed)
        self._read_at = float("-inf")  # when the keys were last read, or last tried
        self._reading: asyncio.Task[None] | None = None
        self._unavailable = ""  # why the keys could not be read (logged once per reason)
        self.reads = 0  # times the set was read (tests, and the operator's log)

    async def verify(self, token: str, audience: str) -> bool:
        """True: the issuer signed this token, for `audience`, valid now. False: the keys cannot be
        read, so nothing was checked (the caller falls back to the TokenReview). TokenRefused: refused."""
        jwt = parse(token)
        if str(jwt.header.get("alg")) not in _HASHES:
            raise TokenRefused(f"tokens signed with {jwt.header.get('alg')!r} are not the issuer's")
        problem = claims_problem(jwt.claims, audience, self._wall())
        if problem:
            raise TokenRefused(problem)
        kid = str(jwt.header.get("kid") or "")
        keys = await self._current(kid)
        if keys is None:
            return False
        candidates = [keys[kid]] if kid in keys else list(keys.values()) if not kid else []
        if not candidates:
            raise TokenRefused("the token is signed with a key the cluster's issuer does not publish")
        if not any(signature_valid(jwt, key) for key in candidates):
            raise TokenRefused("the token's signature is not the cluster issuer's")
        return True

    async def _current(self, kid: str) -> dict[str, PublicKey] | None:
        """The keys to check a token of `kid` with. Waits for a read only when it can change the
        answer (no keys yet, or a kid not among them); a periodic refresh goes on in the background."""
        now = self._clock()
        known = self._keys is not None and (kid in self._keys or not kid)
        if now - self._read_at >= (REFRESH_SECONDS if known else REFETCH_SECONDS):
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._read())
            if not known:
                await asyncio.shield(self._reading)
        return self._keys

    async def _read(self) -> None:
        self._read_at = self._clock()
        self.reads += 1
        try:
            kube = self._kube()
            if kube is None:
                return  # not logged in yet: tried again after REFETCH_SECONDS
            keys = keys_of(await self._jwks(kube))
            if not keys:
                raise ValueError("the issuer's key set has no RSA or EC signing key")
            self._keys, self._unavailable = keys, ""
        except (ApiError, OSError, TimeoutError, ValueError) as e:
            if self._keys is None and str(e) != self._unavailable:
                log.warning("state API: the service-account issuer's keys cannot be read (%s); tokens are "
                            "checked by TokenReview alone until they can", e)
            self._unavailable = str(e)
        finally:
            self._reading = None

    @staticmethod
    async def _jwks(kube: Kube) -> object:
        """The key set, from the API server: at the path of discovery's jwks_uri (which names the
        issuer's public host; the API server answers at the same path), else at Kubernetes' own."""
        try:
            doc = await kube.request("GET", DISCOVERY_PATH)
            uri = doc.get("jwks_uri") if isinstance(doc, dict) else None
            path = urlsplit(uri).path if isinstance(uri, str) else ""
            if path.startswith("/") and path != JWKS_PATH:
                return await kube.request("GET", path)
        except ApiError as e:
            log.debug("service-account issuer discovery: %s; reading %s", e, JWKS_PATH)
        return await kube.request("GET", JWKS_PATH)
