"""Python start-up hook for PYTHONPATH=<this directory>, written by `idemproxy env` (do not
edit): loads idemproxy_worker (see that file for exactly what it does), then the
sitecustomize.py this one hides, if the interpreter has one further along sys.path."""

import importlib.util
import os
import sys

import idemproxy_worker  # noqa: F401


def _run_hidden_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_sitecustomize_after_idemproxy", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_run_hidden_sitecustomize()
