"""Hydra plugin of guardtrain: puts ``pkg://guardtrain.conf`` on every app's search path.

Hydra imports every module under the ``hydra_plugins`` namespace package when
an app starts, so this package imports only Hydra and the standard library.
"""
