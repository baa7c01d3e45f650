"""idemproxy's start-up hook for Python workers, written by `idemproxy env` (rewritten each time:
do not edit). It makes the provider SDKs go through the proxy and trust its CA as shipped, with
no change to the tool's code. Python loads it at start-up in either of two ways:

  * PYTHONPATH=<this directory>: Python imports sitecustomize.py from here, which imports this.
  * idemproxy-worker.pth copied into site-packages (an image step): every process of that
    interpreter loads it, also those started with a cleaned environment (an MCP stdio server
    started by CrewAI gets only HOME, PATH, SHELL, TERM, USER and LOGNAME).

What it does, and nothing else (IDEMPROXY_WORKER=off turns all of it off):

  1. Fills in the worker environment. When HTTPS_PROXY is not set, every variable of
     ../worker.env (next to this directory) that is not set is set (os.environ.setdefault),
     so this process and the processes it starts go through the proxy. A variable the process
     already has is never changed.
  2. stripe: the stripe package pins its own CA bundle (stripe.ca_bundle_path, a file inside
     the package), so REQUESTS_CA_BUNDLE and SSL_CERT_FILE never reach it. When stripe is
     imported, stripe.ca_bundle_path is set to IDEMPROXY_CA_BUNDLE (the proxy's CA plus the
     system roots). A path the program sets afterwards wins.
  3. aiohttp: ClientSession ignores HTTPS_PROXY unless trust_env=True. When aiohttp is
     imported, trust_env defaults to True (what requests, httpx and urllib do already). An
     explicit trust_env=False wins.
"""

import os
import sys

_ENV_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "worker.env")


def _read_env_file(path):
    """NAME=value lines (Docker's --env-file format: no quotes, no expansion, # comments)."""
    values = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#") or "=" not in line:
                    continue
                name, value = line.split("=", 1)
                values[name.strip()] = value
    except OSError:
        pass
    return values


def _fill_environment():
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return
    for name, value in _read_env_file(_ENV_FILE).items():
        os.environ.setdefault(name, value)


def _patch_stripe(stripe):
    bundle = os.environ.get("IDEMPROXY_CA_BUNDLE")
    if bundle:
        stripe.ca_bundle_path = bundle


def _patch_aiohttp(aiohttp):
    session = getattr(aiohttp, "ClientSession", None)
    if session is None or getattr(session.__init__, "_idemproxy", False):
        return
    original = session.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("trust_env", True)
        original(self, *args, **kwargs)

    __init__._idemproxy = True
    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    session.__init__ = __init__


_PATCHES = {"stripe": _patch_stripe, "aiohttp": _patch_aiohttp}


class _AfterImport:
    """Finds nothing itself: for the modules in _PATCHES it asks the other finders, then runs
    the patch right after the module has executed (the first `import stripe`, wherever it is)."""

    _searching = set()

    def find_spec(self, name, path=None, target=None):
        patch = _PATCHES.get(name)
        if patch is None or name in self._searching:
            return None
        self._searching.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._searching.discard(name)
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def _activate():
    if os.environ.get("IDEMPROXY_WORKER", "").lower() in ("off", "0", "false", "no"):
        return
    _fill_environment()
    if not (os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")):
        return
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


_activate()
