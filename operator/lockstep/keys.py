"""Label and annotation keys: the one place they are spelled."""

from __future__ import annotations

DOMAIN = "lockstep.dev"

# Labels on every child object.
JOB = f"{DOMAIN}/job"
ROLE = f"{DOMAIN}/role"
INDEX = f"{DOMAIN}/index"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "lockstep-operator"

# Annotations on pods.
CONFIG_FINGERPRINT = f"{DOMAIN}/config-fingerprint"
TEMPLATE_HASH = f"{DOMAIN}/template-hash"

ACTOR = "actor"
TRAINER = "trainer"
ROLES = (ACTOR, TRAINER)

# The operator's pod watch: only pods it created.
POD_SELECTOR = f"{MANAGED_BY}={MANAGER}"
