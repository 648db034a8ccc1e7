"""Tenant names the services use for their own requests, which no caller's tenant may take.

The gateway sends a request's tenant as its cache salt, which keys the engine's prefix cache and
names the request's namespace in the kvstore. The engine uses two names of its own there: the
namespace of requests that come with no salt, and the salt of its warm-up requests. A caller whose
token named its tenant so would share their cache, so the gateway refuses such a token, and a
tenants file that lists such a tenant.
"""

from __future__ import annotations

UNSALTED_TENANT = "default"  # the kvstore namespace of engine requests with no cache salt
WARM_UP_SALT = "thermocline-warm-up"  # the engine's warm-up requests' prefix-cache salt
RESERVED_TENANTS = frozenset({UNSALTED_TENANT, WARM_UP_SALT})
