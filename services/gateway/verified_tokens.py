"""Tokens that passed every check, so a caller's next calls skip the signature check.

A token's checks split in two. Those fixed by its bytes and the gateway's settings: the header
rules, the signature, `iss`, `aud`, `sub`, `tenant` and the claim types. And those that depend on
when, and against which keys, it is checked: `exp`, `nbf` and `iat` against the clock, and
whether the key that verified it is still in the key set. The cache holds only tokens that passed
both, keyed by their exact text (so by their exact signature), and re-runs the second kind on
every hit: a token that expired, or whose key was retired or reloaded, is refused or verified
again in full, never served from the cache. An RS256 check is about half a millisecond of the
gateway's event loop; a hit costs a dictionary lookup and three comparisons.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from services.common.errors import Unauthenticated
from services.gateway.jwks import VerificationKey

if TYPE_CHECKING:
    from services.gateway.auth import Principal

# Longer tokens are verified every time: they are rare, and the cache's memory stays bounded
# (4096 entries by default, each a token of at most 4 KiB and its parsed claims).
MAX_CACHED_TOKEN_CHARS = 4096


class VerifiedToken(NamedTuple):
    """A token that passed every check: who it names, its header's `kid`, and the key that verified it."""

    principal: Principal
    kid: str | None
    key: VerificationKey


def check_times(claims: dict[str, Any], now_s: float, leeway_s: float) -> None:
    """Refuses a token past `exp`, issued (`iat`) in the future, or before `nbf`, with `leeway_s` of
    clock skew (PyJWT's rules), naming the claim that failed. The first verification and every cache
    hit run this one check, so a token gets the same refusal either way."""
    if int(claims["exp"]) <= now_s - leeway_s:
        raise Unauthenticated("token has expired; mint a new one")
    if "iat" in claims and (ahead_s := int(claims["iat"]) - now_s) > leeway_s:
        raise Unauthenticated(
            f"token was issued in the future (iat is {ahead_s:.0f} s ahead of the gateway's clock, "
            f"more than the {leeway_s:g} s of clock skew allowed); the issuer's clock runs fast: "
            "set it right and mint a new token"
        )
    if "nbf" in claims and int(claims["nbf"]) > now_s + leeway_s:
        raise Unauthenticated("token is not valid yet (nbf is in the future); use it once its nbf has passed")


class VerifiedTokens:
    """A bounded LRU of verified tokens by their text; `get` re-checks the clock and the key.

    An OrderedDict moved-to-end on a hit, so eviction drops the least recently used token in O(1).
    `get` drops a token it refuses; `put` adds one, evicting the oldest past `max_entries`.
    """

    def __init__(self, leeway_s: float, max_entries: int, clock: Callable[[], float] = time.time) -> None:
        self.leeway_s = leeway_s
        self.max_entries = max_entries
        self.clock = clock
        self._tokens: OrderedDict[str, VerifiedToken] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tokens)

    def get(
        self, token: str, key_in_force: Callable[[str | None], VerificationKey | None]
    ) -> Principal | None:
        """The principal of a cached `token` for which `key_in_force(kid)` still returns the key that
        verified it; None when it is not cached or its key changed; Unauthenticated when its time ran out."""
        verified = self._tokens.get(token)
        if verified is None:
            return None
        if key_in_force(verified.kid) is not verified.key:  # retired, or the key file reloaded
            del self._tokens[token]
            return None
        try:
            check_times(verified.principal.claims, self.clock(), self.leeway_s)
        except Unauthenticated:
            del self._tokens[token]
            raise
        self._tokens.move_to_end(token)
        return verified.principal

    def put(self, token: str, verified: VerifiedToken) -> None:
        """Remembers a token that just passed every check."""
        if len(token) > MAX_CACHED_TOKEN_CHARS or self.max_entries == 0:
            return
        self._tokens[token] = verified
        if len(self._tokens) > self.max_entries:
            self._tokens.popitem(last=False)
