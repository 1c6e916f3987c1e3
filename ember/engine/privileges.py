"""Dropping a replica's privileges: root becomes a tenant's unprivileged uid, for good.

The local backend starts a tenant's replica as that uid (``Popen(user=...)``), and a
standby process, started as root before anyone knew its tenant, calls ``drop_to`` on
``/assign`` before it reads anything of the version. Torch-free (the control plane's
backend imports it).
"""

from __future__ import annotations

import os
import resource
import stat
from contextlib import suppress
from pathlib import Path


def raise_memlock() -> None:
    """Lift ``RLIMIT_MEMLOCK`` while still root: the loader ``mlock``s the weights, and an
    unprivileged process keeps the limit it was given (it could never raise it itself)."""
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    with suppress(ValueError, OSError):  # not root, or a container that caps it: keep it
        resource.setrlimit(resource.RLIMIT_MEMLOCK, unlimited)


def drop_to(uid: int, gid: int) -> None:
    """Become ``uid:gid`` irreversibly (real, effective and saved ids; no supplementary
    groups). A process already running as ``uid`` does nothing; one that cannot (not root)
    raises ``PermissionError``."""
    if os.geteuid() == uid and os.getegid() == gid:
        return
    raise_memlock()
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(f"could not drop privileges to {uid}:{gid}")


def blocked_for_others(path: Path) -> Path | None:
    """The first directory on the way to ``path`` (``path`` included, when a directory)
    that a user other than its owner and group cannot traverse; None when all can (a
    directory that does not exist yet is not in the way: whoever makes it sets its mode)."""
    path = path.absolute()
    for step in (*reversed(path.parents), path):
        try:
            mode = step.stat().st_mode
        except FileNotFoundError:
            return None
        except OSError:
            return step
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return step
    return None


def tenant_home(data_dir: Path, tenant_id: int) -> Path:
    """A tenant's replicas' private ``HOME`` (and working directory) on this machine."""
    return data_dir / "replicas" / "home" / f"t{tenant_id}"
