"""kvx as LMCache's PD backend: a drop-in for ``PDBackendAsync`` that an unmodified LMCache
(0.5.6) uses.

Switching is one line, run in every process that runs LMCache before it starts::

    import kvx.lmcache; kvx.lmcache.install()

LMCache's own ``pd_*`` configuration keys keep their meaning; kvx's own settings go under
``extra_config`` as ``kvx_*`` keys (``settings.KVX_EXTRA_KEYS``).

Map:

- ``switch.py``: ``install``/``uninstall``, which put kvx's backend in LMCache.
- ``context.py``: ``transfer(spec)``: which request a staging allocation is for (LMCache's
  ``allocate`` does not say; its ``store`` does).
- ``settings.py``: the configuration, read and checked (errors name the key).
- ``backend.py``: ``KvxPDBackend``, the class LMCache builds.
- ``sender.py`` / ``receiver.py``: the prefill and decode sides.
- ``memory.py``: kvx's slots as LMCache ``MemoryObj``s, in place.

Requires ``lmcache`` and ``torch`` (not dependencies of ``kvx`` itself).
"""

from .backend import KvxPDBackend
from .context import current_transfer, transfer
from .settings import KVX_EXTRA_KEYS, ConfigError, KvxPDSettings
from .switch import install, installed, uninstall

__all__ = [
    "KVX_EXTRA_KEYS",
    "ConfigError",
    "KvxPDBackend",
    "KvxPDSettings",
    "current_transfer",
    "install",
    "installed",
    "transfer",
    "uninstall",
]
